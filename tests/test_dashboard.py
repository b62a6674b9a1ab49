"""``mars dashboard``: the Grafana JSON it writes, and every panel's PromQL run against a REAL
Prometheus (Debian's binary, unpacked by ``scripts/setup_prometheus.sh``) scraping a real
``mars-vllm serve --policy mars`` under a short replay: each query must parse and return data.
Grafana's ``$__rate_interval`` is given a one-minute window, as Grafana would for a 1 s scrape
interval over a short run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mars.dashboard.panels import queries
from mars.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / ".cache" / "prometheus" / "usr" / "bin" / "prometheus"


def test_dashboard_command_writes_every_panel(tmp_path):
    out = tmp_path / "d" / "mars.json"
    r = subprocess.run([sys.executable, "-m", "mars.cli", "dashboard", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    from mars.dashboard.grafana import UID, exprs

    assert d["uid"] == UID and d["templating"]["list"][0]["type"] == "datasource"
    panels = [p for p in d["panels"] if p["type"] == "timeseries"]
    assert panels and all(p["targets"] and p["title"] for p in panels)
    assert exprs(d) == queries()
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
    (tmp_path / "x").write_text("")  # a file where a directory is needed
    r = subprocess.run([sys.executable, "-m", "mars.cli", "dashboard", "--out",
                        str(tmp_path / "x" / "d.json")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("mars dashboard: cannot write ")


class Prometheus:
    """Prometheus on a loopback port, scraping one target every second."""

    def __init__(self, target: str, workdir: Path) -> None:
        self.port = free_port()
        cfg = workdir / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                       "scrape_configs:\n  - job_name: mars\n    static_configs:\n"
                       f"      - targets: ['{target}']\n")
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                (workdir / "prometheus.log").read_text()[-2000:]
            time.sleep(0.2)

    def query(self, expr: str) -> dict:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        return r.json()

    def target_up(self) -> bool:
        t = httpx.get(self.url + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return bool(t) and t[0]["health"] == "up"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.mark.engine
def test_every_panel_query_returns_data_from_a_real_prometheus(tmp_path):
    if not PROMETHEUS.exists():
        pytest.skip(f"no Prometheus at {PROMETHEUS}: scripts/setup_prometheus.sh could not "
                    "fetch Debian's package here")
    from tests.conftest import engine_server

    with engine_server(["--policy", "mars", "--enable-prompt-tokens-details"]) as srv:
        prom = Prometheus(f"127.0.0.1:{srv.port}", tmp_path)
        try:
            # the counters' zeros must be scraped before the replay moves them: a short replay
            # can otherwise end before the first scrape of a loaded machine, and every
            # increase() reads 0
            deadline = time.monotonic() + 60
            while not prom.target_up() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert prom.target_up(), (tmp_path / "prometheus.log").read_text()[-2000:]
            r = subprocess.run(
                [sys.executable, "-m", "mars.cli", "replay", "ILR-1", "--num-tasks", "3",
                 "--scale", "50", "--time-scale", "40", "--rate", "0.5", "--seed", "0",
                 "--tool-burn", "wall", "--no-progress", "--no-plots", "--ideal", "skip",
                 "--url", srv.url, "--out", str(tmp_path / "run")],
                capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            deadline = time.monotonic() + 60  # a few more scrapes after the last request
            while not prom.target_up() and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(3)
            assert prom.target_up()
            empty, failed = [], []
            for expr in queries():
                res = prom.query(expr.replace("$__rate_interval", "1m"))
                if res.get("status") != "success":
                    failed.append((expr, res.get("error")))
                elif not res["data"]["result"]:
                    empty.append(expr)
            assert failed == [] and empty == [], (failed, empty)
            # and the series behind the panels carry what the run did, not only their zeros
            # (every stream series exists from the start, so "returns data" alone would pass
            # with the observer unplugged)
            for expr in ('mars_sidecar_kv_blocks{state="total"}',
                         "increase(mars_sidecar_prompt_tokens_total[10m])",
                         'mars_sidecar_ttft_seconds_count{round="0"}',
                         "sum(mars_sidecar_tool_duration_seconds_count)",
                         "sum(mars_sidecar_window_updates_total)",
                         "sum(mars_sidecar_sessions_ended_total)",
                         "sum(vllm:prompt_tokens_total)"):
                res = prom.query(expr)["data"]["result"]
                assert res and float(res[0]["value"][1]) > 0, (expr, res)
        finally:
            prom.stop()
