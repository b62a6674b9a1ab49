"""One rule set for session metadata: strict at the sidecar (400 naming the field), lenient in
the engine (the bad field is dropped, the request served)."""

from __future__ import annotations

import pytest

from mars.protocol.session import SessionMeta, SessionMetaError
from mars.sidecar.request import BadRequest, parse_generate


@pytest.mark.parametrize("xargs,param", [
    ({"job_id": True}, "vllm_xargs.job_id"),
    ({"job_id": ""}, "vllm_xargs.job_id"),
    ({"job_id": "x" * 257}, "vllm_xargs.job_id"),
    ({"round": "two"}, "vllm_xargs.round"),
    ({"round": 1.5}, "vllm_xargs.round"),
    ({"round": -1}, "vllm_xargs.round"),
    ({"round": False}, "vllm_xargs.round"),
    ({"last_round": "maybe"}, "vllm_xargs.last_round"),
    ({"next_tool": 3}, "vllm_xargs.next_tool"),
    # echoed in JSON (sessions, events) and keying the retention policy's estimates
    ({"job_id": "\ud800"}, "vllm_xargs.job_id"),
    ({"round": 10**9 + 1}, "vllm_xargs.round"),
    ({"next_tool": "t" * 257}, "vllm_xargs.next_tool"),
    ({"prev_tool": "\udfff"}, "vllm_xargs.prev_tool"),
])
def test_the_same_rule_is_strict_at_the_sidecar_and_lenient_in_the_engine(xargs, param):
    with pytest.raises(SessionMetaError) as exc:
        SessionMeta.parse({"job_id": "s", **xargs}, strict=True)
    assert exc.value.param == param
    body = ('{"prompt": "hi", "vllm_xargs": %s}' % __import__("json").dumps(
        {"job_id": "s", **xargs})).encode()
    with pytest.raises(BadRequest) as bad:
        parse_generate(body, {})
    assert bad.value.param == param
    lenient = SessionMeta.from_extra_args({"job_id": "s", "round": 3, **xargs})
    field = param.split(".")[-1]
    good = SessionMeta(job_id="s", round=3)
    for name in SessionMeta.KEYS:
        if name != field:
            assert getattr(lenient, name) == getattr(good, name), name


def test_valid_values_and_the_session_fallback():
    m = SessionMeta.parse({"job_id": 7, "round": 2.0, "last_round": "yes",
                           "next_tool": "bash", "prev_tool": ""}, strict=True)
    assert m == SessionMeta(job_id="7", round=2, last_round=True, next_tool="bash")
    assert SessionMeta.from_extra_args(None, "hdr").job_id == "hdr"
    assert SessionMeta.from_extra_args({"job_id": "a"}, "hdr").job_id == "a"
    assert SessionMeta.parse(m.to_extra_args(), strict=True) == m
