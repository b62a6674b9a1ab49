"""Late binding in the served sidecar's own classes (``EngineSet``, ``ControlPlane``) on
one event loop, no HTTP and no engine: the moments between a session's move and its
waiting request resuming, which the real-process test (tests/test_sidecar_placement.py)
cannot aim at. Each case failed on the first version of the served rebinding (a review
found them): a session traded back and forth between two equal engines without end, and a
client gone just after the move leaving an ended session holding a slot at the engine it
moved to."""

from __future__ import annotations

import asyncio
import time

import pytest

from mars.sidecar.config import SidecarConfig
from mars.sidecar.engines import EngineSet
from mars.sidecar.metrics import SidecarMetrics


def _set(n: int = 2, placement: str = "mars") -> tuple[EngineSet, list[dict]]:
    urls = tuple(f"http://127.0.0.1:{i + 1}" for i in range(n))
    cfg = SidecarConfig(upstream=urls[0], upstreams=urls, admission=True, placement=placement)
    events: list[dict] = []
    es: EngineSet | None = None

    def emit(ev, source):
        events.append(ev)
        es.observe(ev)

    es = EngineSet(cfg, emit, SidecarMetrics())
    return es, events


def _pool(es: EngineSet, rank: int, free: int) -> None:
    now = time.time()
    es.observe({"kind": "scheduler_start", "ts": now, "scheduler_cls": "x", "policy": "mars",
                "total_blocks": 1000, "block_size": 16, "pid": 1, "engine": rank})
    es.observe({"kind": "kv_snapshot", "ts": now, "total_blocks": 1000, "free_blocks": free,
                "used_blocks": 1000 - free, "running": 1, "waiting": 0, "engine": rank})


async def _follow(es: EngineSet, sid: str) -> tuple[int, object]:
    """What app.py does: acquire where the session is placed (``EngineSet.acquire``, which
    follows it when it moved); 1 if it was admitted at another engine than placed."""
    placed, _ = es.place(sid, lambda: 100)
    eng, s = await es.acquire(placed, sid, prompt_tokens=lambda: 100)
    assert eng.control.sessions.get(sid) is s
    return int(eng is not placed), s


def test_two_equal_engines_never_trade_a_queued_session():
    async def main():
        es, _ = _set()
        for r in range(2):
            _pool(es, r, 900)
            es[r].control.step()
        task = asyncio.ensure_future(_follow(es, "s"))
        await asyncio.sleep(0)  # queued at engine 0, its step kicked
        es[1].control.step()  # engine 1's timer lands first
        hops, s = await asyncio.wait_for(task, 5.0)
        return es, hops, s

    es, hops, s = asyncio.run(main())
    assert s.is_admitted and es.router.rebinds == 0 and hops == 0
    assert [e.control.in_use for e in es.engines] == [1, 0]


@pytest.mark.parametrize("leaves", [False, True], ids=["served", "client-gone"])
def test_a_moved_session_is_admitted_where_it_went_and_cleaned_up_there(leaves):
    async def main():
        es, events = _set()
        _pool(es, 0, 900)
        _pool(es, 1, 900)
        es.router._where["h0"] = 0  # one session admitted on engine 0 ...
        es[0].control.core.arrive("h0", time.time())
        es[0].control.step()
        _pool(es, 0, 20)  # ... whose pool is then nearly full: nothing more fits there
        for e in es.engines:
            e.control.step()
        es.router._where["s"] = 0  # placed there when engine 0 still looked roomier
        task = asyncio.ensure_future(_follow(es, "s"))
        await asyncio.sleep(0)
        assert es[0].control.queued == 1
        es[1].control.step()  # engine 1 would admit it: it moves and is admitted at once
        assert es.router.engine_of("s") == 1 and es.router.rebinds == 1
        assert es[1].control.sessions["s"].is_admitted
        if leaves:  # the client goes before its request resumes
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return es, events, None
        return es, events, await asyncio.wait_for(task, 5.0)

    es, events, got = asyncio.run(main())
    ends = [(e["reason"], e.get("engine")) for e in events
            if e["kind"] == "session_end" and e["session_id"] == "s"]
    assert "s" not in es[0].control.sessions and es[0].control.queued == 0
    if leaves:
        # ended where it was: its slot there given back, the router forgets it
        assert ends == [("requeued", 0), ("disconnect", 1)]
        assert es[1].control.in_use == 0 and "s" not in es[1].control.sessions
        assert es.router.engine_of("s") is None
    else:
        hops, s = got
        assert hops == 1 and s.is_admitted and s.inflight == 1 and s.waiting == 0
        assert ends == [("requeued", 0)] and es[1].control.in_use == 1


def _both_full(es: EngineSet) -> None:
    """One session admitted on each engine, then every pool nearly full: a new session
    queues, and no engine would admit it."""
    for r in range(len(es)):
        _pool(es, r, 900)
        es.router._where[f"h{r}"] = r
        es[r].control.core.arrive(f"h{r}", time.time())
        es[r].control.step()
        _pool(es, r, 20)


def test_sessions_queued_at_an_engine_that_goes_down_move_with_their_waiters():
    """An engine found down: the sessions queued at its door go, with their waiting
    requests, to an alive engine's queue (not left to wait for admissions a dead engine
    would make late or never), and are admitted there when it has room."""
    async def main():
        es, events = _set()
        _both_full(es)
        task = asyncio.ensure_future(_follow(es, "s"))
        await asyncio.sleep(0)
        assert es.router.engine_of("s") == 0 and es[0].control.queued == 1
        for e in es.engines:
            e.control.step()
        assert es.router.rebinds == 0 and not task.done()  # no room anywhere: it waits
        es.down(es[0])
        assert es.router.engine_of("s") == 1 and es[1].control.queued == 1
        assert es[0].control.queued == 0 and es.router.moves == 1
        await asyncio.sleep(0)
        assert not task.done()  # queued at engine 1 now, still no room there
        es[1].control.end(es[1].control.sessions["h1"], "last_round")  # h1 done: room
        _pool(es, 1, 900)
        es[1].control.step()
        return es, events, await asyncio.wait_for(task, 5.0)

    es, events, (hops, s) = asyncio.run(main())
    assert hops == 1 and s.is_admitted and es[1].control.sessions["s"] is s
    ends = [(e["reason"], e.get("engine")) for e in events
            if e["kind"] == "session_end" and e["session_id"] == "s"]
    assert ends == [("requeued", 0)]
    assert es.metrics.session_moves._value.get() == 1


@pytest.mark.parametrize("placement", ["round_robin", "vllm_dp"])
def test_under_a_per_call_placer_too_a_dead_engines_queue_moves_and_is_served_there(
        placement):
    """The same under placers that choose anew for every call (they used to be left out:
    the woken request placed its call again, and could leave the session admitted at the
    engine it moved to for a third one). Three engines: the session queued at engine 0
    moves to the one its placer picks, is admitted there, and its request follows it there
    -- not to wherever the placer's next pick would be."""
    async def main():
        es, events = _set(3, placement)
        _both_full(es)
        es.router._where["s"] = 0
        task = asyncio.ensure_future(_follow(es, "s"))
        await asyncio.sleep(0)
        assert es[0].control.queued == 1 and not task.done()
        es.down(es[0])
        to = es.router.engine_of("s")
        assert to in (1, 2) and es[to].control.queued == 1 and es[0].control.queued == 0
        assert es.router.moves == 1
        es[to].control.end(es[to].control.sessions[f"h{to}"], "last_round")  # room there
        _pool(es, to, 900)
        es[to].control.step()
        hops, s = await asyncio.wait_for(task, 5.0)
        return es, events, to, hops, s

    es, events, to, hops, s = asyncio.run(main())
    assert hops == 1 and s.is_admitted and s.inflight == 1
    assert es[to].control.sessions["s"] is s and es.router.engine_of("s") == to
    assert es.router.switches == 0
    assert [e.control.in_use for e in es.engines] == [1, 1, 1]  # h0, s at `to`, the other h
    ends = [(e["reason"], e.get("engine")) for e in events
            if e["kind"] == "session_end" and e["session_id"] == "s"]
    assert ends == [("requeued", 0)]


def test_a_moved_session_is_found_by_its_record_when_a_second_call_went_elsewhere():
    """From a review: under a per-call placer a second call of the moved session, placed
    while the first still waits, sends the router's record of the session to another
    engine. The first call, woken where the session was admitted, must go there (it holds
    the slot) -- not back to the dead engine it queued at, whose control plane would then
    end the record that another engine still counts."""
    async def main():
        es, events = _set(3, "round_robin")
        _both_full(es)
        es.router._where["s"] = 0
        first = asyncio.ensure_future(_follow(es, "s"))
        await asyncio.sleep(0)
        es.down(es[0])
        to = es.router.engine_of("s")
        other = ({1, 2} - {to}).pop()
        es.router._where["s"] = other  # (what place() does for a concurrent call sent there)
        es[to].control.end(es[to].control.sessions[f"h{to}"], "last_round")
        _pool(es, to, 900)
        es[to].control.step()
        hops, s = await asyncio.wait_for(first, 5.0)
        return es, to, hops, s

    es, to, hops, s = asyncio.run(main())
    assert hops == 1 and s.inflight == 1 and es[to].control.sessions["s"] is s
    assert "s" not in es[0].control.sessions and not s.ended


def test_a_followed_engine_that_died_meanwhile_is_not_called():
    """The engine that admitted the moved session was found down before its request woke:
    the request is placed again (an alive engine) rather than sent to a dead one."""
    async def main():
        es, _ = _set(3, "mars")
        _both_full(es)
        es.router._where["s"] = 0
        es[0].control.core.arrive("s", time.time())  # queued at engine 0
        moved = es[1].control
        es.engines[1].alive = False
        got = es.follow("s", moved, lambda: 100)
        return es, got

    es, got = asyncio.run(main())
    assert got.alive and got.rank != 1


def test_with_no_engine_alive_the_queued_sessions_stay():
    async def main():
        es, _ = _set()
        _both_full(es)
        task = asyncio.ensure_future(_follow(es, "s"))
        await asyncio.sleep(0)
        es.down(es[1])
        es.down(es[0])  # the last one: nowhere to go
        assert es.router.engine_of("s") == 0 and es[0].control.queued == 1
        task.cancel()
        return es

    es = asyncio.run(main())
    assert es.router.moves == 0


def test_a_queued_session_still_held_at_another_engine_is_left_where_it_is():
    """From a review: a session with a call still in flight at engine 1 (found down, then
    back) whose next call queued at engine 0; engine 0 goes down. Evacuating it to engine 1,
    which still holds its old record, raised ValueError out of ``down()`` after taking it out
    of engine 0 (session lost). It is now left where it is."""
    async def main():
        es, _ = _set()
        _pool(es, 0, 900)
        es.router._where["h0"] = 0
        es[0].control.core.arrive("h0", time.time())
        es[0].control.step()
        _pool(es, 0, 20)
        _pool(es, 1, 900)
        es.router._where["s"] = 1
        s1 = es[1].control.core.arrive("s", time.time())
        es[1].control.step()
        es[1].control.core.forward(s1, time.time())  # a call in flight at engine 1
        es.down(es[1])
        task = asyncio.ensure_future(_follow(es, "s"))  # its next call: engine 0, queued
        await asyncio.sleep(0)
        assert es.router.engine_of("s") == 0 and es[0].control.queued == 1
        es[1].alive = True  # its /health answered
        es.down(es[0])  # must not raise
        state = (es.router.engine_of("s"), es[0].control.queued, es[1].control.queued)
        task.cancel()
        return state

    assert asyncio.run(main()) == (0, 1, 0)
