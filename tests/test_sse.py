"""SSE lines end where the spec ends them (CRLF, LF, CR), not at U+0085 / U+2028 / U+2029:
JSON leaves those unescaped inside strings, and a generated token can be one (a replay round
of the emulated model failed with ``JSONDecodeError: Unterminated string`` when httpx's
``aiter_lines`` cut its ``data:`` line at one)."""

from __future__ import annotations

import asyncio
import json

import httpx

from mars.protocol.sse import aiter_sse_lines, iter_sse_lines, split_lines


def _event(text: str) -> bytes:
    return ("data: " + json.dumps({"choices": [{"text": text}]}, ensure_ascii=False)
            + "\n\n").encode()


BODY = (_event("a\u0085b") + _event("c\u2028d\u2029e") + _event("plain")
        + b"data: [DONE]\r\n\r\n")


def _data(lines) -> list[str]:
    return [ln[6:] for ln in lines if ln.startswith("data: ")]


def test_a_line_separator_inside_a_json_string_does_not_end_the_line():
    # what httpx does: splits at U+0085 / U+2028 / U+2029, so the JSON breaks
    r = httpx.Response(200, content=BODY)
    cut = _data(r.iter_lines())
    assert cut[0] == '{"choices": [{"text": "a'  # the JSON is cut where the line was
    # ours, in chunks cut anywhere (also inside a multi-byte character and between CR LF)
    for size in (1, 2, 3, 7, len(BODY)):
        chunks = [BODY[i:i + size] for i in range(0, len(BODY), size)]
        data = _data(iter_sse_lines(chunks))
        assert data[-1] == "[DONE]"
        assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == \
            ["a\u0085b", "c\u2028d\u2029e", "plain"]

        async def collect(chunks=chunks):
            async def gen():
                for c in chunks:
                    yield c
            return [ln async for ln in aiter_sse_lines(gen())]

        assert _data(asyncio.run(collect())) == data


def test_crlf_lf_and_cr_end_lines_and_a_trailing_cr_waits():
    assert split_lines(b"a\r\nb\nc\rd\ne\r") == ([b"a", b"b", b"c", b"d"], b"e\r")
    assert list(iter_sse_lines([b"x\r", b"\ny"])) == ["x", "y"]
