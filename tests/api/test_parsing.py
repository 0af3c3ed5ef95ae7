"""Reasoning / tool-call parsing (lily_py.parsing) on the exact text Qwen3.6's chat template
renders for an assistant turn, fed whole, char by char, split at every position and at random
points; and end to end through Model.generate with a scripted token sequence."""
import json
import random

import numpy as np
import pytest

import lily_py
import lily_py.generation_loop
from lily_py.parsing import OutputParser, ToolCall, ToolCallError, parse_tool_call, \
    prompt_opens_reasoning

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "ratio": {"type": "number"},
            "opts": {"type": "object"}, "tags": {"type": "array"},
            "zip": {"type": "string"}, "maybe": {"type": ["integer", "null"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}}}}},
]

CALL_ARGS = [
    ("get_weather", {"city": "Paris <France>\nnorth", "days": 3, "metric": True, "ratio": 0.5,
                     "opts": {"a": [1, 2], "b": "x"}, "tags": ["x", "y"], "zip": "00123",
                     "maybe": None}),
    ("search", {"query": "</think> is not a tag here & <tool_call> neither"}),
]


@pytest.fixture(scope="module")
def tok():
    return lily_py.load(backend="reference").tokenizer


def assistant_output(tok, *, reasoning, content, calls, thinking=True):
    """The text the model is trained to write after the generation prompt: the template's
    rendering of the final assistant turn, minus the generation prompt, up to <|im_end|>."""
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": content, "reasoning_content": reasoning,
             "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                            for n, a in calls]}]
    full = tok.apply_chat_template(msgs, add_generation_prompt=False, tools=TOOLS)
    gen = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tools=TOOLS,
                                  enable_thinking=None if thinking else False)
    start = gen[:gen.rindex("<|im_start|>assistant\n")] + "<|im_start|>assistant\n"
    assert full.startswith(start)
    out = full[len(start):]
    assert out.endswith("<|im_end|>\n")
    out = out[:-len("<|im_end|>\n")]
    if thinking:
        assert gen.endswith("<think>\n") and out.startswith("<think>\n")
        return gen, out[len("<think>\n"):]
    return gen, out


def run(parser, pieces):
    text, reasoning, calls, errors = "", "", [], []
    for p in pieces:
        d = parser.push(p)
        text, reasoning, calls, errors = text + d.text, reasoning + d.reasoning, \
            calls + d.tool_calls, errors + d.errors
    d = parser.finish()
    return text + d.text, reasoning + d.reasoning, calls + d.tool_calls, errors + d.errors


def splits(s, rng):
    yield [s]
    yield list(s)
    for i in range(1, len(s)):
        yield [s[:i], s[i:]]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(s)), min(len(s) - 1, rng.randint(1, 12))))
        yield [s[a:b] for a, b in zip([0] + cuts, cuts + [len(s)])]


def test_template_tool_call_output_parses_at_every_split(tok):
    rng = random.Random(0)
    gen, out = assistant_output(tok, reasoning="I should call the tools.\nTwo of them.",
                                content="Let me check.", calls=CALL_ARGS)
    assert prompt_opens_reasoning(gen)
    # the exact shape the template teaches
    assert "I should call the tools.\nTwo of them.\n</think>\n\nLet me check.\n\n<tool_call>\n" \
           "<function=get_weather>\n<parameter=city>\nParis <France>\nnorth\n</parameter>\n" in out
    assert "</tool_call>\n<tool_call>\n<function=search>" in out
    for pieces in splits(out, rng):
        text, reasoning, calls, errors = run(OutputParser(reasoning=True, tools=TOOLS), pieces)
        assert (text, reasoning, errors) == ("Let me check.", "I should call the tools.\nTwo of them.", [])
        assert [(c.name, c.arguments_dict) for c in calls] == CALL_ARGS
        assert [c.index for c in calls] == [0, 1]
    c = calls[0]
    assert c.id.startswith("call_") and len(c.id) == 29 and c.id != calls[1].id
    assert json.loads(c.arguments) == c.arguments_dict
    assert c.to_openai() == {"id": c.id, "type": "function",
                             "function": {"name": "get_weather", "arguments": c.arguments}}


def test_without_schema_values_stay_strings(tok):
    _, out = assistant_output(tok, reasoning="r", content="", calls=CALL_ARGS[:1])
    _, _, calls, _ = run(OutputParser(reasoning=True), [out])
    args = calls[0].arguments_dict
    assert args["days"] == "3" and args["metric"] == "true" and args["opts"] == '{"a": [1, 2], "b": "x"}'
    assert args["city"] == "Paris <France>\nnorth"


def test_no_thinking_prompt_and_plain_answers(tok):
    rng = random.Random(1)
    gen, out = assistant_output(tok, reasoning="", content="Sunny.", calls=[], thinking=False)
    assert gen.endswith("<think>\n\n</think>\n\n") and not prompt_opens_reasoning(gen)
    # past-turn rendering drops the empty think block for a no-thinking turn: what the model
    # writes is just the answer
    for pieces in splits("Sunny.\nWarm.", rng):
        assert run(OutputParser(reasoning=False, tools=TOOLS), pieces) == ("Sunny.\nWarm.", "", [], [])
    # thinking on, the model closes an empty block right away (what the demo model does)
    for pieces in splits("\n</think>\n\nHello there", rng):
        assert run(OutputParser(reasoning=True), pieces) == ("Hello there", "", [], [])
    # tags never leak partially: nothing shown is ever a prefix of a tag that completes later
    p = OutputParser(reasoning=True)
    shown = ""
    for ch in "abc\n</think>\n\nok":
        d = p.push(ch)
        shown += d.reasoning + d.text
        assert "<" not in shown and "</" not in shown
    assert shown == "abcok"


def test_reasoning_only_and_truncated_outputs():
    # max_tokens inside reasoning: everything is reasoning
    assert run(OutputParser(reasoning=True), ["I am thinking\n", "</thi"]) == \
        ("", "I am thinking\n</thi", [], [])
    # text that only looks like the start of a tag is released at the end
    assert run(OutputParser(), ["a <tool_c"]) == ("a <tool_c", "", [], [])
    assert run(OutputParser(), ["x < y"]) == ("x < y", "", [], [])


def test_malformed_calls_are_reported_not_dropped():
    bad = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>"
    text, _, calls, errors = run(OutputParser(), ["Hi\n\n", bad, "\nafter"])
    assert text == "Hi" + "after" and calls == []
    assert len(errors) == 1 and errors[0].raw == bad and "</function>" in errors[0].message
    # truncated inside a call (max_tokens): reported with the raw text
    cut = "<tool_call>\n<function=f>\n<parameter=a>\n1\n"
    _, _, calls, errors = run(OutputParser(), [cut])
    assert calls == [] and errors[0].raw == cut and "ended inside" in errors[0].message
    # </function> present but </tool_call> missing at the end: accepted
    _, _, calls, errors = run(OutputParser(), ["<tool_call>\n<function=f>\n</function>\n"])
    assert errors == [] and calls[0].name == "f" and calls[0].arguments_dict == {}
    for raw, msg in [("<tool_call>\nhello\n</tool_call>", "no <function"),
                     ("<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>", "unexpected text"),
                     ("<tool_call>\n<function=>\n</function>\n</tool_call>", "empty function name"),
                     ("<tool_call>{not json</tool_call>", "neither")]:
        r = parse_tool_call(raw)
        assert isinstance(r, ToolCallError) and msg in r.message and r.raw == raw
    # the JSON form Qwen models sometimes fall back on
    r = parse_tool_call('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert isinstance(r, ToolCall) and r.arguments_dict == {"x": 1}


def test_value_conversion_by_schema():
    from lily_py.parsing import convert_value
    assert convert_value("12", {"type": "integer"}) == 12
    assert convert_value("12.0", {"type": "integer"}) == 12
    assert convert_value("1.5", {"type": "integer"}) == "1.5"          # does not convert: string
    assert convert_value("abc", {"type": "number"}) == "abc"
    assert convert_value("nan", {"type": "number"}) == "nan"
    assert convert_value("-2.5e3", {"type": "number"}) == -2500.0
    assert convert_value("False", {"type": "boolean"}) is False
    assert convert_value("null", {"type": ["string", "null"]}) is None
    assert convert_value("null", {"type": "string"}) == "null"
    assert convert_value("[1]", {"anyOf": [{"type": "array"}, {"type": "string"}]}) == [1]
    assert convert_value("[1]", {"type": "object"}) == "[1]"
    assert convert_value(" 7 ", {}) == " 7 "


def scripted(monkeypatch, tokens):
    """Make the sampler return ``tokens`` in order (the reference backend samples on the host)."""
    it = iter(tokens)
    monkeypatch.setattr(lily_py.generation_loop, "sample", lambda *a, **k: next(it))


class NullBackend:
    """A backend that computes nothing (the scripted tokens do not depend on the logits)."""
    name, valid = "reference", True

    def __init__(self, vocab):
        self.vocab, self.position = vocab, 0

    def forward(self, ids, *, all_logits):
        self.position += len(ids)
        return np.zeros((len(ids), self.vocab) if all_logits else self.vocab, np.float32)

    def reset(self):
        self.position = 0

    def snapshot(self):
        return self.position

    def restore(self, snap):
        self.position = snap

    @staticmethod
    def snapshot_nbytes(snap):
        return 8


def test_generate_end_to_end_with_a_scripted_model(monkeypatch, tok):
    m = lily_py.load(backend="reference")
    m._backend = NullBackend(m.config.vocab_size)
    t = m.tokenizer
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    _, out = assistant_output(tok, reasoning="Need the tool.", content="Checking.",
                              calls=CALL_ARGS[:1])
    ids = t.encode(out) + [t.token_to_id("<|im_end|>")]
    assert t.token_to_id("</think>") in ids and t.token_to_id("<tool_call>") in ids
    scripted(monkeypatch, ids)
    chunks = list(m.generate(msgs, tools=TOOLS, max_tokens=len(ids) + 5))
    done = [c for c in chunks if c.tool_calls]
    assert len(done) == 1 and done[0].tool_calls[0].arguments_dict == CALL_ARGS[0][1]
    assert chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.reasoning for c in chunks) == "Need the tool."
    assert "".join(c.text for c in chunks) == "Checking."
    assert "".join(c.raw for c in chunks) == out
    # generate_text collects the same
    scripted(monkeypatch, ids)
    r = m.generate_text(msgs, tools=TOOLS, max_tokens=len(ids) + 5)
    assert (r.text, r.reasoning, r.finish_reason, r.raw_text) == \
        ("Checking.", "Need the tool.", "tool_calls", out)
    assert [(c.name, c.arguments_dict) for c in r.tool_calls] == [CALL_ARGS[0]]
    # raw prompts are not parsed unless asked
    scripted(monkeypatch, ids)
    r = m.generate_text("x", max_tokens=len(ids) + 5)
    assert r.text == out and r.tool_calls == [] and r.finish_reason == "stop"
    scripted(monkeypatch, ids)
    r = m.generate_text("x<think>\n", max_tokens=len(ids) + 5, parse_output=True)
    assert r.reasoning == "Need the tool." and len(r.tool_calls) == 1
    # a malformed call through generate
    bad = t.encode("Sure.\n\n<tool_call>\n<function=get_weather>\noops\n</tool_call>") + \
        [t.token_to_id("<|im_end|>")]
    scripted(monkeypatch, bad)
    r = m.generate_text(msgs, tools=TOOLS, enable_thinking=False, max_tokens=50)
    assert r.text == "Sure." and r.tool_calls == [] and r.finish_reason == "stop"
    assert len(r.tool_call_errors) == 1 and r.tool_call_errors[0].raw.startswith("<tool_call>")


def test_section_of_each_pushed_piece():
    """Where each piece (a token's text) belongs: what the server's chat logprobs keep
    ("content") and drop (reasoning, tags, tool calls, the newlines after </think>)."""
    p = OutputParser(reasoning=True, tools=TOOLS)
    pieces = ["Need", " it.", "\n", "</think>", "\n\n", "Sure", ".", "\n\n", "<tool_call>",
              "\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n",
              "</tool_call>", "\n", "Done"]
    got = []
    for piece in pieces:
        p.push(piece)
        got.append(p.section)
    assert got == ["reasoning"] * 4 + ["whitespace", "content", "content", "content"] + \
        ["tool_call"] * 3 + ["whitespace", "content"]
    p = OutputParser(reasoning=False)
    p.push("\n")
    assert p.section == "whitespace"
    p.push("<think>")
    assert p.section == "reasoning"


def test_generate_reports_the_stop_string_sections_and_prompt_length():
    m = lily_py.load(backend="reference", context_length=256)
    msgs = [{"role": "user", "content": "In the beginning"}]
    full = m.generate_text(msgs, max_tokens=12, enable_thinking=False).text
    word = full.split()[2]
    chunks = list(m.generate(msgs, max_tokens=12, enable_thinking=False, stop=["zzz", word]))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_sequence == word
    assert {c.section for c in chunks} == {"content"}
    assert all(c.stop_sequence == "" for c in chunks[:-1])
    g = m.generate(msgs, max_tokens=6, enable_thinking=True)
    assert g.prompt_tokens == len(m.prompt_ids(msgs, enable_thinking=True))   # before prefill
    chunks = list(g)
    assert chunks[-1].stats.prompt_tokens == g.prompt_tokens
    assert [c.section for c in chunks[:2]] == ["reasoning", "reasoning"]    # "\n", "</think>"
    assert chunks[-1].finish_reason == "length" and chunks[-1].stop_sequence == ""
    assert {c.section for c in m.generate("In the beginning", max_tokens=2)} == {""}


def test_chat_output_of_the_demo_model_has_no_think_tags():
    m = lily_py.load(backend="reference")
    msgs = [{"role": "user", "content": "In the beginning"}]
    r = m.generate_text(msgs, max_tokens=12)
    assert "<think>" not in r.text and "</think>" not in r.text
    assert not r.text.startswith("\n")
    assert "</think>" in r.raw_text                 # the demo model closes thinking at once
    assert r.text + r.reasoning and r.raw_text.endswith(r.text)


def test_template_options_pass_through_unchanged(monkeypatch):
    m = lily_py.load(backend="reference")
    seen = {}
    real = m.tokenizer.apply_chat_template

    def spy(messages, **kw):
        seen.setdefault("calls", []).append(kw)
        return real(messages, **kw)
    monkeypatch.setattr(m.tokenizer, "apply_chat_template", spy)
    msgs = [{"role": "user", "content": "hi"}]
    m.generate_text(msgs, max_tokens=1, tools=TOOLS, enable_thinking=False,
                    chat_template_kwargs={"preserve_thinking": True, "custom": [1, {"a": 2}]})
    for kw in seen["calls"]:
        assert kw["tools"] == TOOLS and kw["enable_thinking"] is False
        assert kw["preserve_thinking"] is True and kw["custom"] == [1, {"a": 2}]
    with pytest.raises(TypeError, match="chat_template_kwargs cannot set"):
        m.generate(msgs, chat_template_kwargs={"tools": TOOLS})
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        m.generate(msgs, chat_template_kwargs=[1])
    assert m.prompt_ids(msgs, tools=TOOLS) == m.tokenizer.encode(
        real(msgs, add_generation_prompt=True, tools=TOOLS))
    np.testing.assert_equal(len(m.prompt_ids("abc")), len(m.tokenizer.encode("abc")))
