"""Ctrl-C while a ``mars`` command is still starting (mars.cli.interrupt)."""

from __future__ import annotations

import os
import signal

import pytest

import mars.cli
from mars.cli.interrupt import EarlyInterrupt


@pytest.fixture(autouse=True)
def _ctrl_c_as_in_a_terminal():
    """Python's own Ctrl-C handler for each test: a suite started in the background
    (``nohup make test &``) inherits SIGINT ignored, and an ignored one is left alone."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_a_ctrl_c_during_start_up_is_noted_and_raised_on_release(capsys):
    before = signal.getsignal(signal.SIGINT)
    with EarlyInterrupt("mars x") as early:
        os.kill(os.getpid(), signal.SIGINT)
        assert early.pending  # noted, start-up goes on
        with pytest.raises(KeyboardInterrupt):
            early.release()
    assert signal.getsignal(signal.SIGINT) is before
    assert "mars x: interrupted while starting" in capsys.readouterr().err


def test_a_second_ctrl_c_is_not_held():
    with EarlyInterrupt() as early:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert early.pending


def test_a_command_interrupted_while_starting_exits_130_without_running(monkeypatch, capsys,
                                                                         tmp_path):
    real = mars.cli.build_parser

    def interrupted_while_importing():
        parser = real()
        os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C came while the modules imported
        return parser

    monkeypatch.setattr(mars.cli, "build_parser", interrupted_while_importing)
    before = signal.getsignal(signal.SIGINT)
    assert mars.cli.main(["model", "tiny", str(tmp_path / "m")]) == 130
    assert not (tmp_path / "m").exists()  # the command never ran
    assert "mars: interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before


def test_mars_replay_is_handed_a_ctrl_c_noted_while_it_started(monkeypatch):
    """The command that stops gracefully (``mars replay``) gets the note, not an exception:
    it then writes its partial results (tests/test_replay_engine.py) and exits 130."""
    real = mars.cli.build_parser
    seen = {}

    def parser_with_a_recording_replay():
        parser = real()
        os.kill(os.getpid(), signal.SIGINT)  # during start-up
        return parser

    def fake_replay(args):
        seen["pending"] = args.early_interrupt.pending
        return 130

    import mars.cli.replay as replay_cli

    monkeypatch.setattr(mars.cli, "build_parser", parser_with_a_recording_replay)
    monkeypatch.setattr(replay_cli, "cmd_replay", fake_replay)
    assert mars.cli.main(["replay", "ILR-1", "--url", "http://127.0.0.1:9"]) == 130
    assert seen == {"pending": True}


def test_an_ignored_ctrl_c_stays_ignored():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with EarlyInterrupt():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
