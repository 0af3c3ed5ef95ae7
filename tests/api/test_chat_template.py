"""lily_py's chat-template renderer against strings rendered by transformers 5.24.

The expected strings in tests/fixtures/chat/cases.json come from transformers' apply_chat_template
(tokenize=False); regenerate them with tests/fixtures/make_chat_fixtures.py. This file needs only
jinja2 and tokenizers.
"""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import jinja2
import pytest

from lily_py.chat_template import ChatTemplateError, render_chat_template
from lily_py.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "chat"
TOK_DIR = FIXTURES / "tokenizer"
TEMPLATE = ROOT / "src" / "lily_py" / "templates" / "qwen3_5_chat_template.jinja"
CASES = json.loads((FIXTURES / "cases.json").read_text(encoding="utf-8"))
QWEN_CASES = [c for c in CASES["chat"] if c["template"] is None]
PROBE_CASES = [c for c in CASES["chat"] if c["template"] is not None]


def first_difference(a: str, b: str) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at char {i}: ours {a[i:i + 40]!r} vs transformers {b[i:i + 40]!r}"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TOK_DIR)


def test_fixture_template_is_the_shipped_template():
    # The fixtures were rendered from a copy of the shipped template; a stale copy would test nothing.
    assert (TOK_DIR / "chat_template.jinja").read_bytes() == TEMPLATE.read_bytes(), (
        "tests/fixtures/chat is stale: rerun tests/fixtures/make_chat_fixtures.py"
    )


def test_fixture_covers_the_required_cases():
    names = {c["name"] for c in QWEN_CASES}
    kwargs = [c["kwargs"] for c in QWEN_CASES]
    assert {True, False, None} == {k.get("enable_thinking") for k in kwargs}
    assert {True, False} == {k["add_generation_prompt"] for k in kwargs}
    assert any(c["tools"] for c in QWEN_CASES)
    assert any(any(m.get("tool_calls") for m in c["messages"]) for c in QWEN_CASES)
    assert any(any(m["role"] == "tool" for m in c["messages"]) for c in QWEN_CASES)
    assert any(any("reasoning_content" in m for m in c["messages"]) for c in QWEN_CASES)
    assert any(m["role"] == "system" for c in QWEN_CASES for m in c["messages"])
    multi_turn = next(c for c in QWEN_CASES if c["name"] == "multi_turn_inline_think")
    assert sum(m["role"] == "user" for m in multi_turn["messages"]) == 2
    assert {n for n in names if n.startswith("error_")}


def test_special_tokens_match_transformers(tok):
    assert tok.special_tokens == CASES["special_tokens_map"]
    assert tok.chat_template == TEMPLATE.read_text(encoding="utf-8")


@pytest.mark.parametrize("case", QWEN_CASES, ids=[c["name"] for c in QWEN_CASES])
def test_qwen_template_matches_transformers(tok, case):
    kwargs = dict(case["kwargs"])
    if "error" in case:
        with pytest.raises(ChatTemplateError) as info:
            tok.apply_chat_template(case["messages"], tools=case["tools"], **kwargs)
        assert case["error"]["message"] in str(info.value)
        assert str(TOK_DIR / "chat_template.jinja") in str(info.value)  # names the template file
        return
    ours = tok.apply_chat_template(case["messages"], tools=case["tools"], **kwargs)
    assert ours == case["expected"], first_difference(ours, case["expected"])
    ids, want = tok.encode(ours), case["expected_ids"]
    first = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
    assert ids == want, f"token ids differ from transformers' at position {first}"


@pytest.mark.parametrize("case", PROBE_CASES, ids=[c["name"] for c in PROBE_CASES])
def test_environment_matches_transformers(tok, case):
    kwargs = dict(case["kwargs"])
    render = lambda: render_chat_template(  # noqa: E731
        case["template"], case["messages"], tools=case["tools"], special_tokens=tok.special_tokens, **kwargs)
    if "error" in case:
        with pytest.raises(ChatTemplateError) as info:
            render()
        assert case["error"]["message"] in str(info.value)
        return
    ours = render()
    assert ours == case["expected"], first_difference(ours, case["expected"])


def test_enable_thinking_none_leaves_variable_undefined(tok):
    # None must not be passed as enable_thinking=None (the template tests "is defined").
    source = "{{ enable_thinking is defined }}"
    msgs = [{"role": "user", "content": "x"}]
    tok_copy = Tokenizer(tok.backend, chat_template=source, special_tokens=tok.special_tokens)
    assert tok_copy.apply_chat_template(msgs) == "False"
    assert tok_copy.apply_chat_template(msgs, enable_thinking=False) == "True"


def test_default_add_generation_prompt_is_true(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs).endswith("<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_messages_are_not_mutated(tok):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning": "r", "tool_calls": None}]
    before = json.dumps(msgs)
    tok.apply_chat_template(msgs + [{"role": "user", "content": "q2"}])
    assert json.dumps(msgs) == before


def test_strftime_now():
    out = render_chat_template("{{ strftime_now('%Y-%m-%d') }}", [{"role": "user", "content": ""}])
    today = {datetime.date.today().isoformat(), (datetime.date.today() - datetime.timedelta(days=1)).isoformat()}
    assert out in today  # the day may roll over between the two calls


def test_sandbox_blocks_python_internals():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="sandbox"):
        render_chat_template("{{ ''.__class__.__mro__ }}", msgs)
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", msgs)
    with pytest.raises(ChatTemplateError, match="sandbox"):
        render_chat_template("{% set l = [1] %}{{ l.append(2) }}", msgs)  # immutable sandbox


def test_syntax_error_is_reported_with_line():
    with pytest.raises(ChatTemplateError, match="line 2"):
        render_chat_template("ok\n{% if %}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, exc, text", [
    ([], ValueError, "empty"),
    ("hello", TypeError, "list of dicts"),
    ([{"role": "user", "content": "a"}, "b"], TypeError, r"messages\[1\]"),
    ([{"content": "no role"}], ValueError, r"messages\[0\].*role"),
])
def test_bad_messages(tok, messages, exc, text):
    with pytest.raises(exc, match=text):
        tok.apply_chat_template(messages)


def test_bad_tools(tok):
    with pytest.raises(TypeError, match=r"tools\[0\]"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[lambda city: city])
    with pytest.raises(TypeError, match="tools must be a list"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tools={"type": "function"})


def test_reserved_keyword_rejected(tok):
    with pytest.raises(TypeError, match="messages"):
        render_chat_template("x", [{"role": "user", "content": "x"}], messages=[])


def test_no_chat_template_is_a_clear_error(tmp_path):
    shutil.copyfile(TOK_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"no chat template.*chat_template\.jinja"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_from_tokenizer_config(tmp_path):
    shutil.copyfile(TOK_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"eos_token": "<|im_end|>", "chat_template": "A{{ eos_token }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "A<|im_end|>"
    # a named list: "default", or "tool_use" when tools are given (transformers' get_chat_template)
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    named = Tokenizer.from_dir(tmp_path)
    assert named.chat_template == "D"
    assert named.apply_chat_template([{"role": "user", "content": "x"}]) == "D"
    assert named.apply_chat_template([{"role": "user", "content": "x"}], tools=[]) == "T"
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*none named 'default'"):
        Tokenizer.from_dir(tmp_path)
    # chat_template.jinja wins over tokenizer_config.json, as in transformers
    (tmp_path / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "J"


def test_jinja_version_supports_items_filter():
    # The Qwen template iterates tool-call arguments with `|items` (added in Jinja2 3.1).
    major, minor = (int(x) for x in jinja2.__version__.split(".")[:2])
    assert (major, minor) >= (3, 1)
