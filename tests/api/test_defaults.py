"""The defaults are stated once, by the code: the context default is load()'s everywhere it is
quoted, the README's defaults table and CLI reference are generated from the signatures and the
parser (tools/api_reference.py; tests/api/test_docs_generated.py checks they are current)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import lily_py
from lily_py.cli import main

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TOOL = os.path.join(ROOT, "tools", "api_reference.py")


def readme() -> str:
    return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def block(cmd: str) -> str:
    """The body of README's generated block of ``cmd``."""
    m = re.search(r"<!-- gen(?:-raw)?: " + re.escape(cmd) + r" -->\n(.*?)<!-- end gen -->", readme(), re.S)
    assert m, f"README.md has no generated block of `{cmd}`"
    return m[1]


def test_no_context_constant_that_load_does_not_use():
    # load() takes the model's max_position_embeddings; a 32768 constant beside it said otherwise
    assert not hasattr(lily_py, "DEFAULT_CONTEXT")
    assert lily_py.load().context_length == lily_py.load().config.max_position_embeddings


def test_info_states_memory_at_the_context_load_uses(capsys):
    cfg = lily_py.load().config
    assert main(["info"]) == 0
    assert f"memory at context {cfg.max_position_embeddings} " in capsys.readouterr().out
    assert main(["info", "--context", "4096"]) == 0
    assert "memory at context 4096 " in capsys.readouterr().out


def test_readme_defaults_table_is_the_signatures():
    body = block("python tools/api_reference.py defaults")
    rows = {(m[1], m[2]): m[3] for m in re.finditer(r"^\| `(\w+)\(\)` \| `(\w+)` \| `([^`]*)`", body, re.M)}
    assert rows[("load", "context_length")] == "None" and rows[("load", "backend")] == "'auto'"
    assert rows[("generate", "max_tokens")] == str(lily_py.DEFAULT_MAX_TOKENS)
    assert rows[("load", "prompt_cache_bytes")] == str(lily_py.DEFAULT_PROMPT_CACHE_BYTES)
    import inspect
    for name, fn in (("load", lily_py.load), ("generate", lily_py.Model.generate)):
        for p in inspect.signature(fn).parameters.values():
            if p.default is not p.empty:
                assert rows[(name, p.name)] == repr(p.default), (name, p.name)
    assert "max_position_embeddings" in body and "32768" not in readme()


def test_readme_cli_reference_has_every_subcommand_and_flag():
    body = block("python tools/api_reference.py cli")
    from lily_py.cli import parser
    import argparse
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert f"lily-py {name} " in body, name
        for action in p._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert any(f in body for f in action.option_strings), (name, action.option_strings)
    for flag in ("--backend", "--context", "--system", "--kv-dtype", "--thinking"):
        assert flag in body
    assert "{metal,emu,cuda}" in body        # doctor --device cuda


def test_a_parameter_defaulting_to_none_must_say_what_none_means(monkeypatch):
    sys.path.insert(0, os.path.dirname(TOOL))
    import api_reference
    api_reference.defaults()          # every None default has its sentence
    monkeypatch.delitem(api_reference.NONE_MEANS["load"], "kv_dtype")
    with pytest.raises(SystemExit, match=r"load\(kv_dtype=...\) defaults to None"):
        api_reference.defaults()


def test_top_level_help_is_plain_text():
    p = subprocess.run([sys.executable, "-m", "lily_py.cli", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "Qwen3.6-35B-A3B" in p.stdout
    assert "``" not in p.stdout and ":mod:" not in p.stdout
