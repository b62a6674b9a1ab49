"""End to end: concurrent OpenHands agents against a running mars server.

Skipped unless ``MARS_TEST_URL`` points at one (the sidecar, or ``mars-vllm serve`` itself):

    MARS_TEST_URL=http://127.0.0.1:8000 .venv-agents/bin/python -m pytest tests/agents/test_oh_e2e.py

What the server side must provide (see docs/openhands.md):
* ``GET /v1/models`` and ``POST /v1/chat/completions`` (streaming) with tools and
  ``tool_choice="required"`` (guided decoding keeps a random-weight model's calls valid JSON);
  the agent's prompt is ~6.6K tokens (system prompt + tool schemas), so max_model_len must
  leave room for that plus a few rounds of output;
* ``vllm_xargs`` accepted in the request body;
* ``POST /v1/mars/events`` accepting a JSON list of events (``MARS_TEST_EVENTS_URL`` may point
  elsewhere; ``none`` skips event delivery checks).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("openhands.sdk")

URL = os.environ.get("MARS_TEST_URL")
pytestmark = [
    pytest.mark.agents,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not URL, reason="set MARS_TEST_URL to a running mars server"),
]


def test_two_concurrent_agents_run_several_rounds(tmp_path):
    from mars.openhands_integration.endpoints import discover_model
    from mars.openhands_integration.runner import run_tasks
    from mars.openhands_integration.tasks import load_tasks

    events_url = os.environ.get("MARS_TEST_EVENTS_URL", "")
    check_events = events_url.lower() != "none"
    rounds = int(os.environ.get("MARS_TEST_ROUNDS", "4"))
    model = os.environ.get("MARS_TEST_MODEL") or discover_model(URL)
    tasks = load_tasks("bundled")[:2]
    cfg = {
        "url": URL, "model": model, "max_rounds": rounds,
        "events_url": None if not check_events else events_url,
        "max_output_tokens": int(os.environ.get("MARS_TEST_MAX_TOKENS", "128")),
        "llm_timeout_s": 120, "num_retries": 1, "default_timeout_s": 20, "max_timeout_s": 30,
        "out_dir": str(tmp_path / "run"),
    }
    s = run_tasks(tasks, cfg, concurrency=2, label="e2e", start_method="forkserver")
    results = [r for r in map(__import__("json").loads, (tmp_path / "run" / "results.jsonl").read_text().splitlines())]
    assert s["tasks"] == 2
    for r in results:
        # a random-weight model will not solve anything, but the loop must run and end
        assert r["status"] in ("finished", "max_rounds", "stuck"), r
        assert r["llm_calls"] >= 2, r
        assert r["llm_errors"] == 0, r
        assert r["leftover_processes"] == 0
    assert sum(r["tool_calls"] for r in results) >= 1
    if check_events:
        assert s["events"]["sent"] == s["events"]["emitted"] > 0, s["events"]
        assert s["events"]["dropped"] == 0
