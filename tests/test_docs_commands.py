"""Every `mars ...` command the README and docs/ name exists: each command line in a code
block or inline code is walked down the CLI's own parser tree as far as its words name
subcommands, and that command's --help must work. A doc that names a command the CLI does not
have (as `mars openhands run` once was) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mars.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a command line: a code line or inline span that starts with the command
_CMD = re.compile(r"^\s*(?:\$ )?(?:\.venv/bin/)?mars ((?:[a-z][a-z0-9-]*)(?: [a-z][a-z0-9-]*)*)")


def _code(text: str) -> list[str]:
    """Fenced code blocks' lines and inline code spans."""
    out: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append(line.split(" #")[0])  # a shell comment names no command
        else:
            out.extend(re.findall(r"`([^`]+)`", line))
    return out


def _subparsers(parser):
    for a in parser._actions:
        if a.__class__.__name__ == "_SubParsersAction":
            return a.choices
    return None


def _command_paths() -> dict[tuple[str, ...], str]:
    """{subcommand path: where it was first named}."""
    root = build_parser()
    found: dict[tuple[str, ...], str] = {}
    for doc in DOCS:
        for snippet in _code(doc.read_text()):
            for m in _CMD.finditer(snippet):
                words, parser, path = m.group(1).split(), root, []
                for w in words:
                    choices = _subparsers(parser)
                    if not choices or w not in choices:
                        break
                    parser = choices[w]
                    path.append(w)
                key = tuple(path) if path else (words[0],)
                found.setdefault(key, f"{doc.name}: {snippet.strip()[:80]}")
    return found


PATHS = _command_paths()


def test_the_docs_name_commands():
    assert len(PATHS) >= 15 and ("sim", "run") in PATHS and ("openhands",) in PATHS


@pytest.mark.parametrize("path", sorted(PATHS), ids=" ".join)
def test_every_documented_command_exists_and_has_help(path, capsys):
    if path == ("openhands",):
        return  # hands --help to the agent runner (tests/test_openhands_cli.py)
    root_cmds = _subparsers(build_parser())
    assert path[0] in root_cmds, f"no command `mars {path[0]}` ({PATHS[path]})"
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0, PATHS[path]
    assert "usage: mars" in capsys.readouterr().out
