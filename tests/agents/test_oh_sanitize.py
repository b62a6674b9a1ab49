"""Tool arguments are logged without file contents or secrets."""

from __future__ import annotations

from mars.openhands_integration.sanitize import digest, redact, sanitize_args


def test_file_contents_become_length_and_hash():
    out = sanitize_args({"command": "create", "path": "/w/a.py", "file_text": "x = 1\n" * 100,
                         "old_str": "secret sauce", "new_str": ""})
    assert out["command"] == "create" and out["path"] == "/w/a.py"
    assert out["file_text"] == digest("x = 1\n" * 100)
    assert out["file_text"].startswith("<600 chars sha256:")
    assert "secret sauce" not in str(out)
    assert out["new_str"].startswith("<0 chars")


def test_secrets_are_redacted_in_commands():
    cases = {
        "export OPENAI_API_KEY=sk-abcdefghijklmnopqrstuvwx && run": "sk-abcdefghijklmnopqrstuvwx",
        'curl -H "Authorization: Bearer abcdefghijklmnop1234" http://x': "abcdefghijklmnop1234",
        "git clone https://user:hunter2@example.com/r.git": "hunter2",
        "mysql --password hunter3 -u root": "hunter3",
        "DB_PASSWORD='p a s s' ./app": "p a s s",
        "aws s3 ls # AKIAABCDEFGHIJKLMNOP": "AKIAABCDEFGHIJKLMNOP",
        "echo ghp_0123456789abcdefghijABCDEFGHIJ": "ghp_0123456789abcdefghijABCDEFGHIJ",
    }
    for cmd, secret in cases.items():
        red = redact(cmd)
        assert secret not in red, (cmd, red)
    # ordinary commands pass unchanged
    for cmd in ("grep token file.txt", "ls -la /w", "python3 -m pytest -q"):
        assert redact(cmd) == cmd


def test_secret_named_arguments_and_nesting():
    out = sanitize_args({"env": {"API_KEY": "abc", "HOME": "/w"}, "items": [{"token": "t"}, "ok"],
                         "command": "x" * 1000})
    assert out["env"] == {"API_KEY": "***", "HOME": "/w"}
    assert out["items"] == [{"token": "***"}, "ok"]
    assert len(out["command"]) < 400 and "+700 chars" in out["command"]
