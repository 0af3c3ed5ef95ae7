"""State stays consistent when things go wrong, and bad input is refused before any work."""
import json
import os
import shutil

import numpy as np
import pytest

import lily_py
from lily_py.checkpoint import load_weights
from lily_py.errors import CheckpointError, ConfigError, ContextLengthError
from lily_py.testing import make_checkpoint


@pytest.fixture
def model(chat_ckpt):
    return lily_py.load(chat_ckpt, backend="reference")


def test_exception_inside_a_forward_pass_leaves_the_state_untouched(model, rng, monkeypatch):
    import lily_py.reference.model as refmodel
    ids = rng.integers(0, 575, 15)
    expected = lily_py.load(model.path).prefill(ids, all_logits=True)
    model.prefill(ids[:10])
    real, calls = refmodel.moe_block, [0]

    def failing(*args, **kw):
        calls[0] += 1
        if calls[0] == 4:                       # the 4th layer's MoE of the next call
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(refmodel, "moe_block", failing)
    with pytest.raises(KeyboardInterrupt):
        model.prefill(ids[10:15])
    monkeypatch.setattr(refmodel, "moe_block", real)
    assert model.position == 10
    np.testing.assert_allclose(model.prefill(ids[10:15], all_logits=True), expected[10:],
                               rtol=1e-4, atol=1e-4)


def test_returned_logits_are_the_callers_to_modify(model, rng):
    ids = [int(t) for t in rng.integers(0, 575, 9)]
    clean = lily_py.load(model.path).generate_text(ids, max_tokens=5).tokens
    logits = model.prefill(ids)
    logits[:] = 0.0
    logits[3] = 100.0                            # a caller's in-place edit
    r = model.generate_text(ids, max_tokens=5)   # reuses the state, and its own logits
    assert r.stats.reused_tokens == len(ids) and r.tokens == clean


def test_prefill_past_the_context_feeds_nothing(chat_ckpt):
    m = lily_py.load(chat_ckpt, context_length=10, prefill_chunk=4)
    with pytest.raises(ContextLengthError):
        m.prefill(list(range(1, 13)))
    assert m.position == 0
    m.prefill([1, 2, 3])
    with pytest.raises(ContextLengthError, match="feeding 8 tokens after 3"):
        m.prefill(list(range(1, 9)))
    assert m.position == 3


@pytest.mark.parametrize("prompt, exc, msg", [
    ([1.7, 2.9], TypeError, "integers"),
    ([[1, 2], [3, 4]], ValueError, "1-D"),
    (np.array([True, False]), TypeError, "booleans"),
    (np.array([[1, 2]]), ValueError, "1-D"),
    ([1, 9999], ValueError, "token id 9999 at index 1"),
])
def test_generate_rejects_bad_token_ids(model, prompt, exc, msg):
    with pytest.raises((exc, TypeError, ValueError), match=msg):
        model.generate(prompt, max_tokens=1)


def test_message_objects_other_than_dicts_go_to_the_template(model):
    from dataclasses import dataclass

    @dataclass
    class Msg:
        role: str
        content: str
    a = model.generate_text([Msg("user", "hi")], max_tokens=3, enable_thinking=False)
    model.reset()
    b = model.generate_text([{"role": "user", "content": "hi"}], max_tokens=3,
                            enable_thinking=False)
    assert a.tokens == b.tokens


def test_regenerating_a_reply_keeps_the_next_turn_reusable(model):
    msgs = [{"role": "user", "content": "Hello"}]
    model.generate_text(msgs, max_tokens=4, enable_thinking=False)
    r = model.generate_text(msgs, max_tokens=4, enable_thinking=False, temperature=1.0, seed=3)
    head = model.tokenizer.encode(model.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=False, enable_thinking=False))
    assert r.stats.reused_tokens == len(head)
    nxt = msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "And?"}]
    r2 = model.generate_text(nxt, max_tokens=4, enable_thinking=False)
    assert r2.stats.reused_tokens >= len(head) > 0


def test_generator_as_context_manager(model):
    with model.generate([1, 2, 3], max_tokens=10) as g:
        for _ in g:
            break
    model.generate_text([4, 5], max_tokens=2)


def test_context_length_above_the_model_maximum_is_refused(chat_ckpt):
    with pytest.raises(ValueError, match=r"context_length must be an integer in \[1, 4096\]"):
        lily_py.load(chat_ckpt, context_length=5000)


def test_missing_vision_only_shard_is_fine(tmp_path):
    """A hub download leaves out shards that hold only skipped (vision) tensors."""
    p = make_checkpoint(tmp_path / "c", fmt="hf", dtype="f32", shards=2)
    from safetensors.numpy import save_file
    save_file({"model.visual.blocks.0.w": np.ones((2, 2), np.float32)},
              os.path.join(p, "model-vision.safetensors"))
    idx = json.load(open(os.path.join(p, "model.safetensors.index.json")))
    idx["weight_map"]["model.visual.blocks.0.w"] = "model-vision.safetensors"
    json.dump(idx, open(os.path.join(p, "model.safetensors.index.json"), "w"))
    assert load_weights(p)[1].skipped == {"vision tower": 1}
    os.remove(os.path.join(p, "model-vision.safetensors"))
    _, w = load_weights(p)
    assert len(w.files) == 2
    os.remove(os.path.join(p, "model-00001-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="missing from"):
        load_weights(p)


def test_unsupported_quantization_methods_and_dtypes(tiny_mlx, tmp_path):
    p = shutil.copytree(tiny_mlx, tmp_path / "c")
    cfg = json.load(open(p / "config.json"))
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    cfg.pop("quantization")
    json.dump(cfg, open(p / "config.json", "w"))
    with pytest.raises(ConfigError, match="'fp8' checkpoints are not supported"):
        lily_py.load(str(p))
    # an FP8 tensor in the file: the dtype is named
    q = tmp_path / "d"
    make_checkpoint(q, fmt="hf", dtype="f32")
    f = q / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k.endswith("norm.weight"))
    header[name]["dtype"] = "F8_E4M3"
    header[name]["data_offsets"][1] = header[name]["data_offsets"][0] + int(np.prod(header[name]["shape"]))
    h = json.dumps(header).encode()
    f.write_bytes(len(h).to_bytes(8, "little") + h + data[8 + n:])
    with pytest.raises(CheckpointError, match=rf"{name}' has dtype 'F8_E4M3'"):
        load_weights(q)


def test_chat_cli_survives_a_failed_turn(chat_ckpt):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "lily_py.cli", "chat", "--model", chat_ckpt,
                        "--context", "40", "--max-tokens", "2"],
                       input="Hi\n" + "a very long message " * 10 + "\n/reset\nHi\n/exit\n",
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "exceed" in p.stderr or "context length" in p.stderr
    assert p.stderr.count("[length]") + p.stderr.count("[stop]") == 2
