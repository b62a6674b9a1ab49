"""The tool-event sink never blocks the agent and never loses events silently."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from mars.openhands_integration.sink import EventSink, events_url
from mars.protocol.events import make_event, parse_events

pytestmark = pytest.mark.timeout(60)


def _ev(i: int, sid: str = "s1") -> dict:
    return make_event("tool_start", session_id=sid, tool="terminal", round=i, call_id=f"c{i}")


def test_events_url_forms():
    assert events_url("http://h:1") == "http://h:1/v1/mars/events"
    assert events_url("http://h:1/") == "http://h:1/v1/mars/events"
    assert events_url("http://h:1/v1") == "http://h:1/v1/mars/events"
    assert events_url("http://h:1/v1/mars/events") == "http://h:1/v1/mars/events"
    assert events_url(None) is None


def test_batches_reach_the_sidecar_in_order(stub, tmp_path):
    path = tmp_path / "ev.jsonl"
    sink = EventSink(stub.url, path=path, batch_size=8)
    for i in range(30):
        sink.emit(_ev(i))
    assert sink.flush(5.0)
    sink.close()
    assert [e["round"] for e in stub.events] == list(range(30))
    parse_events(stub.events)  # the sidecar's own validation accepts the batches
    assert stub.event_posts < 30  # batched
    assert sink.stats.sent == 30 and sink.stats.dropped == 0
    lines = path.read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == list(range(30))


def test_session_end_goes_with_the_api_key_apart_from_tool_events(stub):
    """A tool-runner key may post tool events but not ``session_end`` (the sidecar answers a
    batch that mixes them 403 and would lose the tool events too): the sink posts the end of
    a session apart, with the API key."""
    sink = EventSink(stub.url, batch_size=64, headers={"authorization": "Bearer tools"},
                     session_headers={"authorization": "Bearer api"})
    for i in range(3):
        sink.emit(_ev(i))
    sink.emit(make_event("session_end", session_id="s1", reason="last_round"))
    assert sink.flush(5.0)
    sink.close()
    assert sink.stats.sent == 4 and sink.stats.dropped == 0
    for auth, kinds in stub.event_auth:
        assert auth == ("Bearer api" if "session_end" in kinds else "Bearer tools"), (auth, kinds)
        assert "session_end" not in kinds or set(kinds) == {"session_end"}
    assert sorted(e["kind"] for e in stub.events) == ["session_end"] + ["tool_start"] * 3


def test_a_session_end_never_overtakes_tool_events_waiting_for_a_retry():
    """The tool events' post fails (sidecar briefly down): the session's end waits with them
    and arrives after them, not before."""
    from oh_stub import StubOpenAI

    with StubOpenAI(fail_event_posts=1) as stub:
        sink = EventSink(stub.url, batch_size=64, headers={"authorization": "Bearer tools"},
                         session_headers={"authorization": "Bearer api"})
        for i in range(3):
            sink.emit(_ev(i))
        sink.emit(make_event("session_end", session_id="s1", reason="last_round"))
        assert sink.flush(10.0)
        sink.close()
        kinds = [e["kind"] for e in stub.events]
        assert kinds == ["tool_start"] * 3 + ["session_end"], (kinds, stub.event_auth)
        assert stub.event_auth[0] == ("Bearer tools", ["tool_start"] * 3)  # the failed post


def test_nothing_listening_never_blocks_and_counts_drops(free_port):
    sink = EventSink(f"http://127.0.0.1:{free_port}", max_buffer=50, max_retry=20, batch_size=10)
    t0 = time.perf_counter()
    worst = 0.0
    for i in range(2000):
        s = time.perf_counter()
        sink.emit(_ev(i))
        worst = max(worst, time.perf_counter() - s)
    elapsed = time.perf_counter() - t0
    # 2000 emits with no network wait anywhere (a connect attempt alone takes longer than
    # these bounds; they are loose only because the test machine may be busy)
    assert elapsed < 2.0, elapsed
    assert worst < 0.25, worst
    t1 = time.perf_counter()
    sink.close(timeout_s=1.0)
    assert time.perf_counter() - t1 < 3.0
    st = sink.stats
    assert st.sent == 0
    assert st.posts_failed >= 1
    assert st.dropped > 0
    assert st.dropped == st.emitted  # every event is accounted for as dropped
    assert "Connect" in (st.last_error or "") or "refused" in (st.last_error or "").lower()


def test_hanging_sidecar_fills_the_buffer_without_blocking():
    """A sidecar that accepts connections but never answers: emit still returns at once."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
                conns.append(c)  # never read, never answer
            except OSError:
                continue

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        port = srv.getsockname()[1]
        sink = EventSink(f"http://127.0.0.1:{port}", max_buffer=100, max_retry=100, timeout_s=2.0)
        t0 = time.perf_counter()
        for i in range(1000):
            sink.emit(_ev(i))
        assert time.perf_counter() - t0 < 1.5  # the POST hangs for 2 s meanwhile
        assert sink.stats.dropped >= 700  # buffer (100) full while the POST hangs
        sink.close(timeout_s=0.5)
        assert sink.stats.sent == 0
        assert sink.stats.dropped == sink.stats.emitted
    finally:
        stop.set()
        th.join(1)
        for c in conns:
            c.close()
        srv.close()


def test_sidecar_recovers_and_retried_events_arrive(stub):
    stub.events_status = 503
    sink = EventSink(stub.url, max_backoff_s=0.1)
    for i in range(5):
        sink.emit(_ev(i))
    deadline = time.time() + 5
    while sink.stats.posts_failed == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert sink.stats.posts_failed >= 1 and sink.stats.sent == 0
    stub.events_status = 200
    for i in range(5, 8):
        sink.emit(_ev(i))
    assert sink.flush(5.0)
    sink.close()
    assert [e["round"] for e in stub.events] == list(range(8))
    assert sink.stats.dropped == 0


def test_rejected_batch_is_dropped_not_retried(stub):
    stub.events_status = 422
    sink = EventSink(stub.url)
    sink.emit(_ev(0))
    sink.flush(2.0)
    sink.close()
    assert stub.event_posts == 1
    assert sink.stats.dropped == 1 and sink.stats.sent == 0


def test_local_only_sink_writes_the_file(tmp_path):
    path = tmp_path / "sub" / "ev.jsonl"
    with EventSink(None, path=path) as sink:
        for i in range(3):
            sink.emit(_ev(i))
    assert len(path.read_text().splitlines()) == 3
    assert sink.stats.written == 3 and sink.stats.dropped == 0
