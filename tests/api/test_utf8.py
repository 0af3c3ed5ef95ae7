"""Text that is not valid UTF-8 (or not valid Unicode: a lone surrogate) gets an error that says
what and where, on every route in: stdin, --prompt, chat's input lines, and Python strings at
the API and the tokenizer. (It used to be the tokenizer's "TextInputSequence must be str".)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import lily_py

BAD = b"In the \xff beginning"          # byte 7 is not UTF-8


def cli(args, stdin: bytes = b""):
    env = dict(os.environ, PYTHONIOENCODING="utf-8", LC_ALL="C.UTF-8")
    return subprocess.run([sys.executable.encode(), b"-m", b"lily_py.cli", *args], input=stdin,
                          capture_output=True, env=env, timeout=300)


def test_stdin_prompt():
    p = cli([b"generate", b"--raw", b"--max-tokens", b"2"], stdin=BAD)
    err = p.stderr.decode()
    assert p.returncode == 2 and "the prompt on stdin is not valid UTF-8 at byte 7 (0xff)" in err, err
    assert "TextInputSequence" not in err and "Traceback" not in err


def test_prompt_argument():
    p = cli([b"generate", b"--raw", b"--max-tokens", b"2", b"-p", BAD])
    err = p.stderr.decode()
    assert p.returncode == 2 and "--prompt is not valid UTF-8 at byte 7 (0xff)" in err, err
    p = cli([b"generate", b"--max-tokens", b"2", b"-p", b"ok", b"--system", b"\xc3("])
    assert p.returncode == 2 and "--system is not valid UTF-8 at byte 0 (0xc3)" in p.stderr.decode()


def test_chat_line_is_refused_and_the_session_goes_on():
    p = cli([b"chat", b"--max-tokens", b"2"], stdin=BAD + b"\nIn the beginning\n")
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert "input line 1 is not valid UTF-8 at byte 7 (0xff)" in err
    assert err.count("[length]") == 1          # the second line got its reply


@pytest.fixture(scope="module")
def demo():
    return lily_py.load(backend="reference")


@pytest.mark.parametrize("prompt, msg", [
    ("ab\udcffc", r"the prompt contains a lone surrogate U\+DCFF at index 2 \(the byte 0xff"),
    ([{"role": "user", "content": "ab\ud800"}],
     r"messages\[0\]\['content'\] contains a lone surrogate U\+D800 at index 2"),
    ([{"role": "system", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "x\udc80"}]}],
     r"messages\[1\]\['content'\]\[0\]\['text'\] contains a lone surrogate U\+DC80 at index 1"),
])
def test_python_strings_with_lone_surrogates(demo, prompt, msg):
    with pytest.raises(ValueError, match=msg):
        demo.generate(prompt, max_tokens=1)
    with pytest.raises(ValueError, match=msg):
        demo.prompt_ids(prompt)
    assert demo.generate_text("In the beginning", max_tokens=1).tokens     # still usable


def test_tokenizer_boundary(demo):
    with pytest.raises(ValueError, match=r"the text to encode contains a lone surrogate U\+DFFF at index 0"):
        demo.tokenizer.encode("\udfff")
    assert demo.tokenizer.encode("caf\u00e9 \U0001f600")        # valid non-ASCII text encodes
