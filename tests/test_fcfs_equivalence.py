"""`--policy fcfs` must give the same greedy outputs as stock vLLM on the same prompts."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.conftest import BASE_ARGS

pytestmark = pytest.mark.engine

PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 140)), [7] * 33]


def _greedy(url: str, model: str) -> list[list[int]]:
    outs = []
    for p in PROMPTS:
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": p, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        outs.append(r.json()["choices"][0]["token_ids"])
    return outs


def test_fcfs_matches_stock_vllm(fcfs_server):
    """(``mars-vllm serve``'s default policy, on the server this module shares:
    tests/conftest.py; the prompts share no block with any other test's.)"""
    pytest.importorskip("vllm")
    from mars.launch import free_port
    from mars.model.tiny import default_model_dir, write_tiny_model

    model = str(write_tiny_model(default_model_dir()))
    ours = _greedy(fcfs_server.url, "mars-tiny")

    port = free_port()
    log = open(os.path.join(tempfile.mkdtemp(), "stock.log"), "wb")
    stock = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--served-model-name", "mars-tiny", "--port", str(port), "--host", "127.0.0.1",
         "--block-size", "32", "--enforce-eager", *BASE_ARGS],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert stock.poll() is None, open(log.name).read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "stock vLLM did not start"
            time.sleep(0.5)
        theirs = _greedy(f"http://127.0.0.1:{port}", "mars-tiny")
    finally:
        os.killpg(stock.pid, 15)
        stock.wait(timeout=30)
    assert ours == theirs
    assert all(len(o) == 12 for o in ours)
