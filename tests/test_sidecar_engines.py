"""One sidecar in front of two engines (issue #34, the external load-balancing shape):
``mars sidecar --upstream URL1,URL2`` before two ``mars-vllm serve --no-sidecar`` servers on
the emulated GPU. What each engine served is read from that engine's own events."""

from __future__ import annotations

import time
import zlib

import httpx
import pytest

from mars.protocol.events import parse_event
from tests.conftest import read_events

pytestmark = pytest.mark.engine

GPU, MODEL = "h100-nvl", "qwen3-coder-30b-a3b"
SERVED = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
SESSIONS = 6


@pytest.fixture(scope="module")
def stack():
    pytest.importorskip("vllm")
    from mars.launch import ServerProcess
    from mars.sidecar.process import SidecarProcess

    a = ServerProcess(args=["--emulate", f"{GPU}:{MODEL}", "--policy", "mars",
                            "--no-sidecar"]).start()
    try:
        b = ServerProcess(args=["--emulate", f"{GPU}:{MODEL}", "--policy", "mars",
                                "--no-sidecar"]).start()
    except BaseException:
        a.stop()
        raise
    sc = None
    try:
        sc = SidecarProcess(f"{a.url},{b.url}", args=[
            "--placement", "mars", "--events-file", a.events_file + ".sidecar"]).start()
        yield a, b, sc
    finally:
        if sc is not None:
            sc.stop()
        b.stop()
        a.stop()


def _round(url: str, sid: str, rnd: int, last: bool = False,
           headers: dict | None = None) -> httpx.Response:
    # each session its own context, growing by round (token ids in the vocabulary of the
    # embedded tokenizer the emulated model is served with)
    seed = zlib.crc32(sid.encode())
    base = [100 + (seed + i * 104729) % 800 for i in range(400)]
    prompt = base + [7] * (50 * rnd)
    return httpx.post(url + "/v1/completions", timeout=120, headers=headers, json={
        "model": SERVED, "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
        "vllm_xargs": {"job_id": sid, "round": rnd, "last_round": last}})


def _wait_ends(files, prefix: str, n: int, timeout_s: float = 30.0) -> None:
    """Until the engines' own event files hold ``n`` ends of calls of sessions ``prefix*``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = sum(1 for f in files for ev in read_events(f, "gpu_end")
                  if str(ev.get("session_id")).startswith(prefix))
        if got >= n:
            return
        assert time.monotonic() < deadline, f"{got} of {n} call ends in the engines' events"
        time.sleep(0.1)


def _rounds_by_file(files, prefix: str = "") -> list[dict[str, set[int]]]:
    """Per engine events file: each session (id starting with ``prefix``) and the rounds
    that engine was submitted."""
    out = []
    for f in files:
        got: dict[str, set[int]] = {}
        for ev in read_events(f, "gpu_submit"):
            sid = ev.get("session_id")
            if sid and str(sid).startswith(prefix):
                got.setdefault(sid, set()).add(ev.get("round"))
        out.append(got)
    return out


def _sessions_by_engine(*servers) -> list[dict[str, set[int]]]:
    return _rounds_by_file([srv.events_file for srv in servers])


def test_every_round_of_a_session_lands_on_one_engine_and_both_serve(stack):
    a, b, sc = stack
    sids = [f"dp-s{i}" for i in range(SESSIONS)]
    for rnd in range(3):
        for sid in sids:
            r = _round(sc.url, sid, rnd)
            assert r.status_code == 200, r.text
    _wait_ends((a.events_file, b.events_file), "dp-s", 3 * SESSIONS)
    on_a, on_b = _sessions_by_engine(a, b)
    # every session on exactly one engine, all three rounds there
    for sid in sids:
        assert (sid in on_a) != (sid in on_b), (sid, on_a, on_b)
        assert (on_a.get(sid) or on_b.get(sid)) == {0, 1, 2}
    # placement spread them: each engine serves some (equal engines, equal sessions)
    assert on_a and on_b, (on_a, on_b)
    st = sc.state()
    pl = st["placement"]
    assert pl["placement"] == "mars" and pl["moves"] == 0 and pl["switches"] == 0
    assert [e["rank"] for e in pl["engines"]] == [0, 1]
    assert all(e["alive"] for e in pl["engines"])
    # each engine's control plane admitted the sessions placed on it, no more
    assert {e["rank"]: e["admitted"] for e in pl["engines"]} == {0: len(on_a), 1: len(on_b)}
    view = httpx.get(sc.url + "/v1/mars/sessions", timeout=10).json()["sessions"]
    assert {s["session_id"]: s["engine"] for s in view} == {
        **{sid: 0 for sid in on_a}, **{sid: 1 for sid in on_b}}
    # the sidecar's merged stream: every event valid, each engine's tagged with its rank
    time.sleep(0.5)  # (its file is written every 0.1 s)
    merged = read_events(a.events_file + ".sidecar")
    for ev in merged:
        parse_event(ev)
    snaps = {ev["engine"] for ev in merged if ev["kind"] == "kv_snapshot"}
    assert snaps == {0, 1}


def test_a_dead_engines_sessions_move_and_are_counted(stack):
    a, b, sc = stack
    for i in range(4):  # (sessions of its own: the test runs alone too)
        assert _round(sc.url, f"dp-m{i}", 0).status_code == 200
    _wait_ends((a.events_file, b.events_file), "dp-m", 4)
    on_a, on_b = _sessions_by_engine(a, b)
    moving = sorted(sid for sid in on_b if sid.startswith("dp-m"))
    assert moving, on_b
    moves_before = sc.state()["placement"]["moves"]
    b.stop()  # engine 1 gone
    for sid in moving:
        r = _round(sc.url, sid, 3)
        assert r.status_code == 200, r.text  # served by engine 0 instead, in the same call
    stayed = sum(1 for sid in on_a if sid.startswith("dp-m"))
    _wait_ends((a.events_file,), "dp-m", stayed + len(moving))
    now_a = _sessions_by_engine(a)[0]
    for sid in moving:
        assert 3 in now_a.get(sid, set()), (sid, now_a)
    pl = sc.state()["placement"]
    assert pl["moves"] - moves_before == len(moving), pl
    assert [e["alive"] for e in pl["engines"]] == [True, False]
    metrics = httpx.get(sc.url + "/metrics", timeout=10).text
    assert f"mars_sidecar_session_moves_total {float(pl['moves'])}" in metrics
    # the sessions that stayed on engine 0 are not moved, and new ones go there
    r = _round(sc.url, "dp-new", 0)
    assert r.status_code == 200, r.text
    assert sc.state()["placement"]["moves"] == pl["moves"]


@pytest.fixture(scope="module")
def dp_server():
    """One ``mars-vllm serve --data-parallel-size 2`` server (vLLM's two engines and its DP
    coordinator behind one API), the sidecar in front placing sessions by rank header."""
    pytest.importorskip("vllm")
    from mars.launch import ServerProcess

    with ServerProcess(args=["--emulate", f"{GPU}:{MODEL}", "--policy", "mars",
                             "--data-parallel-size", "2"]) as srv:
        yield srv


def test_the_ranks_of_one_data_parallel_server_each_keep_their_sessions(dp_server):
    from mars.stream.publisher import rank_path

    srv = dp_server
    sids = [f"dpr-s{i}" for i in range(4)]
    files = [srv.events_file, rank_path(srv.events_file, 1)]

    for rnd in range(2):
        for sid in sids:
            r = _round(srv.url, sid, rnd)
            assert r.status_code == 200, r.text
    _wait_ends(files, "dpr-", 2 * len(sids))
    placed = _rounds_by_file(files, "dpr-")
    # a round that names the other rank itself: the sidecar's placement wins over it
    for sid in sids:
        other = 1 if sid in placed[0] else 0
        r = _round(srv.url, sid, 2, headers={"X-data-parallel-rank": str(other)})
        assert r.status_code == 200, r.text
    _wait_ends(files, "dpr-", 3 * len(sids))
    by_rank = _rounds_by_file(files, "dpr-")
    # each rank's scheduler saw its own sessions, every round of each, and none of the other's
    for sid in sids:
        assert (sid in by_rank[0]) != (sid in by_rank[1]), by_rank
        assert (by_rank[0].get(sid) or by_rank[1].get(sid)) == {0, 1, 2}
    assert by_rank[0] and by_rank[1], by_rank
    st = httpx.get(srv.url + "/v1/mars/state", timeout=10).json()["placement"]
    assert [e["rank"] for e in st["engines"]] == [0, 1]
    # the sidecar read each rank's events from that rank's own endpoint
    assert all(e["engine_events_received"] > 0 for e in st["engines"]), st
    assert {e["rank"]: e["admitted"] for e in st["engines"]} == {
        0: len(by_rank[0]), 1: len(by_rank[1])}


def _free_port_pair() -> int:
    """A port P with P + 1 free too (data-parallel rank r publishes on P + r)."""
    import socket

    from mars.launch import free_port

    for _ in range(100):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


def test_engines_on_two_nodes_publish_to_one_sidecar_over_tcp():
    """vLLM's data parallelism across nodes, both "nodes" on this machine as separate
    process trees that meet over TCP only: the API node runs rank 0 (``--data-parallel-size
    2 --data-parallel-size-local 1``), a ``--headless`` node rank 1, each engine publishing
    its events on tcp; the API node's sidecar, told every rank's endpoint, places sessions on
    both engines by rank header and keeps every round of a session on one."""
    pytest.importorskip("vllm")
    import json

    from mars.launch import ServerProcess, free_port
    from mars.stream.publisher import rank_path

    ev, rpc = _free_port_pair(), free_port()
    common = ["--emulate", f"{GPU}:{MODEL}", "--policy", "mars", "--data-parallel-size", "2",
              "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(rpc)]
    other = ServerProcess(args=[*common, "--headless", "--data-parallel-start-rank", "1",
                                "--mars-events-endpoint", f"tcp://0.0.0.0:{ev}"]).start()
    try:
        endpoints = f"tcp://127.0.0.1:{ev},tcp://127.0.0.1:{ev + 1}"
        with ServerProcess(args=[*common, "--mars-events-endpoint", f"tcp://127.0.0.1:{ev}",
                                 "--sidecar-args", json.dumps({"engine-events": endpoints})]
                           ) as front:
            files = [front.events_file, rank_path(other.events_file, 1)]
            sids = [f"mn-s{i}" for i in range(4)]
            for rnd in range(3):
                for sid in sids:
                    r = _round(front.url, sid, rnd, last=rnd == 2)
                    assert r.status_code == 200, r.text
            _wait_ends(files, "mn-", 3 * len(sids))
            by_rank = _rounds_by_file(files, "mn-")
            # each node's engine served whole sessions, and both served some
            assert by_rank[0] and by_rank[1], by_rank
            for sid in sids:
                assert (sid in by_rank[0]) != (sid in by_rank[1]), by_rank
                assert (by_rank[0].get(sid) or by_rank[1].get(sid)) == {0, 1, 2}
            st = httpx.get(front.url + "/v1/mars/state", timeout=10).json()["placement"]
            # the sidecar read the other node's engine over tcp
            assert [e["rank"] for e in st["engines"]] == [0, 1]
            assert all(e["engine_events_received"] > 0 for e in st["engines"]), st
    finally:
        other.stop()


@pytest.mark.parametrize("extra,match", [
    # a headless node's engines cannot be read on an ipc socket from another node
    (["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--headless",
      "--data-parallel-start-rank", "1"], "tcp://0.0.0.0:PORT"),
    (["--data-parallel-size", "2", "--data-parallel-size-local", "1"],
     "1 of the 2 data-parallel engines"),
    (["--data-parallel-size", "4", "--nnodes", "2", "--node-rank", "0"],
     "2 of the 4 data-parallel engines"),
    # the API node's sidecar must be told where the other node's engines publish
    (["--data-parallel-size", "2", "--data-parallel-size-local", "1",
      "--mars-events-endpoint", "tcp://0.0.0.0:5600"], "1 of the 2 data-parallel engines"),
    (["--data-parallel-size", "3", "--data-parallel-size-local", "1",
      "--mars-events-endpoint", "tcp://0.0.0.0:5600",
      "--sidecar-args", '{"engine-events": "tcp://a:5600,tcp://b:5601"}'], r"\(got 2\)"),
])
def test_engines_on_other_nodes_need_tcp_endpoints_and_every_ranks_named(extra, match):
    pytest.importorskip("vllm")
    from mars.engine.harness.sim_engine import engine_args_for

    with pytest.raises(SystemExit, match=match):
        engine_args_for(f"{GPU}:{MODEL}", "mars", extra)


@pytest.mark.parametrize("extra", [
    ["--data-parallel-size", "2"],  # every engine here: the derived endpoints are right
    ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--headless",
     "--data-parallel-start-rank", "1", "--mars-events-endpoint", "tcp://0.0.0.0:5600"],
    ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--no-sidecar",
     "--mars-events-endpoint", "tcp://0.0.0.0:5600"],
    ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
     "--mars-events-endpoint", "tcp://0.0.0.0:5600",
     "--sidecar-args", '{"engine-events": "tcp://127.0.0.1:5600,tcp://b:5601"}'],
    # this node's engine on ipc (its sidecar is here too), the other's on tcp
    ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
     "--sidecar-args", '{"engine-events": "ipc:///tmp/x.ipc,tcp://b:5601"}'],
    ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
     "--sidecar-args", '{"engine-events": "none"}'],
    # hybrid and external load balancing: each API server fronts its own engines
    ["--data-parallel-size", "4", "--data-parallel-size-local", "2",
     "--data-parallel-start-rank", "2"],
    ["--data-parallel-size", "4", "--data-parallel-rank", "3"],
])
def test_engines_on_several_nodes_with_their_endpoints_are_accepted(extra):
    pytest.importorskip("vllm")
    from mars.engine.harness.sim_engine import engine_args_for

    from mars.engine.serve.dp_layout import data_parallel_layout

    args = engine_args_for(f"{GPU}:{MODEL}", "mars", extra)
    assert args.data_parallel_size >= 2
    # every engine publishes at its rank behind its own API server
    assert args.additional_config["mars"]["rank_base"] == data_parallel_layout(args).rank_base


@pytest.mark.parametrize("flags,want", [
    # (size, local, start, api ranks, rank base, remote)
    ([], (1, 1, 0, [0], 0, False)),
    (["--data-parallel-size", "4"], (4, 4, 0, [0, 1, 2, 3], 0, False)),
    # internal load balancing across nodes: the API node fronts every rank
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2"],
     (4, 2, 0, [0, 1, 2, 3], 0, True)),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--headless",
      "--data-parallel-start-rank", "2"], (4, 2, 2, [], 0, True)),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "0"],
     (4, 0, 0, [0, 1, 2, 3], 0, True)),
    # --nnodes infers the local size and, on other nodes, the first rank
    (["--data-parallel-size", "4", "--nnodes", "2", "--node-rank", "0"],
     (4, 2, 0, [0, 1, 2, 3], 0, True)),
    # hybrid: each node's API server fronts its own ranks, by local header
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2",
      "--data-parallel-start-rank", "2"], (4, 2, 2, [2, 3], 2, False)),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2",
      "--data-parallel-hybrid-lb"], (4, 2, 0, [0, 1], 0, False)),
    # external: one engine behind each API server
    (["--data-parallel-size", "4", "--data-parallel-rank", "3"], (4, 1, 3, [3], 3, False)),
])
def test_which_engines_a_server_runs_and_fronts_is_read_as_vllm_reads_it(flags, want):
    pytest.importorskip("vllm")
    from mars.engine.serve.cli import build_parser
    from mars.engine.serve.dp_layout import data_parallel_layout

    parser, _ = build_parser()
    lay = data_parallel_layout(parser.parse_args(["serve", *flags]))
    assert (lay.size, lay.local, lay.start, list(lay.api_ranks), lay.rank_base,
            lay.remote) == want
