"""The bundled demo checkpoint: loads with no download, and lily_py's reference reproduces
mlx-lm's greedy continuations recorded when it was built (src/lily_py/demo/expected_greedy.json,
mlx-lm in float32 on the same 4-bit weights, itself cross-checked against transformers)."""
import json
import os

import numpy as np
import pytest

import lily_py
from tolerances import assert_close


@pytest.fixture(scope="module")
def demo():
    return lily_py.load(backend="reference", kv_dtype="bfloat16")   # as mlx-lm: no int8 cache


@pytest.fixture(scope="module")
def expected():
    with open(os.path.join(lily_py.demo_path(), "expected_greedy.json")) as f:
        return json.load(f)


def test_demo_has_the_real_architecture(demo):
    c = demo.config
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert c.linear_num_value_heads == 2 * c.linear_num_key_heads
    assert c.num_attention_heads > c.num_key_value_heads and c.rotary_dim == c.head_dim // 4
    assert c.rope_theta == 1e7 and not c.tie_word_embeddings
    w = demo.weights
    assert w.format == "mlx" and w.embed.bits == 4 and w.lm_head.bits == 4
    assert w.layers[0].moe.router.bits == 8 and w.layers[0].moe.shared_expert_gate.bits == 8
    assert w.layers[0].moe.gate_proj.bits == 4


def check(demo, case, ids):
    demo.reset()
    assert ids == case["prompt_ids"]
    logits = demo.prefill(ids)
    ref = np.asarray(case["prompt_last_logits"], np.float32)
    # same tolerance rule as the oracle fixtures (tests/reference/test_oracles.py): fp32
    # accumulation-order differences are ~1e-6 relative to the logit scale
    assert_close(logits, ref, atol=1e-4 * np.abs(ref).max(), rtol=1e-4, what="prompt logits")
    out = []
    for _ in range(len(case["greedy_ids"])):
        t = int(np.argmax(logits))
        out.append(t)
        logits = demo.decode(t)
    assert out == case["greedy_ids"]
    return out


def test_raw_prompt_matches_mlx_lm(demo, expected):
    out = check(demo, expected, demo.tokenizer.encode(expected["prompt"]))
    assert demo.tokenizer.decode(out) == expected["greedy_text"]


def test_chat_prompt_matches_mlx_lm(demo, expected):
    case = expected["chat"]
    text = demo.tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True,
                                              enable_thinking=case["enable_thinking"])
    assert text == case["prompt"]
    check(demo, case, demo.tokenizer.encode(text))
    r = demo.generate_text(case["messages"], max_tokens=len(case["greedy_ids"]),
                           enable_thinking=case["enable_thinking"])
    assert r.tokens == case["greedy_ids"] and r.text == case["greedy_text"]


def test_demo_is_confident(demo, expected):
    """Trained weights: greedy choices are not near-ties (why the demo is trained, not random)."""
    demo.reset()
    logits = demo.prefill(demo.tokenizer.encode(expected["prompt"]))
    gaps = []
    for t in expected["greedy_ids"][:16]:
        top2 = np.sort(logits)[-2:]
        gaps.append(top2[1] - top2[0])
        logits = demo.decode(t)
    assert min(gaps) > 1e-2, gaps


def test_demo_chat_template_is_the_shipped_template():
    """The demo carries a copy of the Qwen template; a template change must regenerate it."""
    here = os.path.dirname(lily_py.__file__)
    with open(os.path.join(here, "templates", "qwen3_5_chat_template.jinja")) as a, \
            open(os.path.join(lily_py.demo_path(), "chat_template.jinja")) as b:
        assert a.read() == b.read(), "re-run tools/make_demo.py after changing the template"
