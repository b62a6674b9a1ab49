"""Ctrl-C while a ``mars`` command is still starting (mars.cli.interrupt)."""

from __future__ import annotations

import os
import signal

import pytest

import mars.cli
from mars.cli.interrupt import EarlyInterrupt


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
