"""The lily-py command line, run in-process and as a real console script."""
import subprocess
import sys

import pytest

import lily_py
from lily_py.cli import main


def test_generate_streams_the_same_text_as_the_api(chat_ckpt, capsys):
    assert main(["generate", "--model", chat_ckpt, "--prompt", "Hello there", "--raw",
                 "--max-tokens", "7"]) == 0
    out, err = capsys.readouterr()
    expected = lily_py.load(chat_ckpt).generate_text("Hello there", max_tokens=7)
    assert out == expected.text + "\n"
    assert "[length] prompt" in err and "generated 7 tokens" in err


def test_generate_chat_mode_uses_the_template(chat_ckpt, capsys):
    assert main(["generate", "-m", chat_ckpt, "-p", "Hi", "--max-tokens", "4", "--no-thinking",
                 "--system", "Be brief.", "-q"]) == 0
    out, err = capsys.readouterr()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert out == lily_py.load(chat_ckpt).generate_text(msgs, max_tokens=4,
                                                        enable_thinking=False).text + "\n"
    assert err == ""


def test_errors_are_one_line_not_tracebacks(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lily-py: error:") and "no such folder" in err and "Traceback" not in err


def test_info(chat_ckpt, capsys):
    assert main(["info", "--model", chat_ckpt]) == 0
    out = capsys.readouterr().out
    assert "qwen3_5_moe: 4 layers (3 Gated DeltaNet + 1 full attention)" in out
    assert "format: mlx (norms stored folded)" in out


def test_chat_session_over_stdin(chat_ckpt):
    p = subprocess.run([sys.executable, "-m", "lily_py.cli", "chat", "--model", chat_ckpt,
                        "--max-tokens", "3"],
                       input="Hello\nAgain\n/reset\nThird\n/exit\n", capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    # piped: no ">>> " prompts anywhere; stdout carries the three replies alone
    assert ">>>" not in p.stdout and ">>>" not in p.stderr and p.stdout.count("\n") == 3
    assert "(conversation cleared)" in p.stderr
    # turn 2 reused the state of turn 1
    stats = [l for l in p.stderr.splitlines() if l.startswith("[")]
    assert len(stats) == 3 and "(0 reused" in stats[0] and "(0 reused" not in stats[1]
    assert "(0 reused" in stats[2]


@pytest.mark.parametrize("flags, msg", [
    (["--temperature", "-1"], "temperature must be >= 0"), (["--top-p", "0"], "top_p must be in"),
    (["--max-tokens", "0"], "max_tokens must be a positive integer"),
    (["--seed", "-3"], "seed must be a non-negative integer")])
@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_sampling_flags_are_checked_before_the_model_loads(monkeypatch, capsys, cmd, flags, msg):
    import lily_py.model
    monkeypatch.setattr(lily_py.model, "load", lambda *a, **k: pytest.fail("loaded before checking"))
    assert main([cmd, "-p", "x", *flags] if cmd == "generate" else [cmd, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lily-py: error:") and msg in err
