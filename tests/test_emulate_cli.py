"""``mars emulate``: the step-time model from the command line (no vLLM needed)."""

from __future__ import annotations

import pytest

from mars.cli import main


def test_profiles_step_and_compare_print_emulated_numbers(capsys):
    assert main(["emulate", "profiles"]) == 0
    main_profiles_out = out = capsys.readouterr().out
    assert "emulated GPU" in out and "| h100 | qwen3-coder-30b-a3b |" in out
    assert "| h100-nvl | gpt-oss-120b | derived h100-nvl (from measured h100) |" in out
    assert main(["emulate", "step", "--gpu", "h200", "--model", "gpt-oss-120b",
                 "--decode", "16", "--context", "8000", "--prefill", "2048"]) == 0
    out = capsys.readouterr().out
    assert "emulated GPU" in out and "step" in out and "attention" in out
    assert main(["emulate", "compare"]) == 0
    out = capsys.readouterr().out
    assert "oss-h100-32k" in out and "measured: over the 13 points not taken" in out
    assert "| h100 | qwen3-coder-30b-a3b | measured h100 |" in main_profiles_out


def test_bad_input_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown GPU"):
        main(["emulate", "step", "--gpu", "a100", "--model", "gpt-oss-120b", "--decode", "1"])
    with pytest.raises(SystemExit, match="--decode"):
        main(["emulate", "step", "--gpu", "h100", "--model", "gpt-oss-120b"])
