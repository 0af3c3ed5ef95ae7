"""Host overhead of decoding (not a test): what the host spends per token when the device costs
nothing.

    python benchmarks/host_overhead.py [--tokens 2000] [--repeat 200]

Runs on the counting device, which encodes every step and runs nothing:

1. Encoding one decode step of the real 35B config (40 layers, 256 experts, context 256; greedy
   and with the full sampler): the engine's own steady-clock time around the encode
   (stats['encode_ns']), median over --repeat steps.
2. Python overhead per streamed token: Model.generate on "count_host" (the counting device with
   host memory: the engine's host-side reads work, every sampled token is 0) with a one-layer
   random checkpoint that has the real vocabulary (248,320 logits: a logits row is 1 MB) and
   the demo tokenizer. Per token: wall time of one next() of the generator, minus the engine's
   encode time of that step (stats['encode_ns']) = the Python side; median (robust against
   other processes taking the CPU) and mean.
3. Time to first token of the same model, host work only (prefill of 16 tokens + first sample),
   greedy and with temperature / top-k / top-p.
4. A response_format constraint (llguidance): per token of a JSON answer to a nested schema, the
   matcher's next-token bitset (compute_bitmask) and its advance (consume_token), on the demo
   tokenizer (2,048 ids: the real 248K-id Qwen3.6 tokenizer is not available offline), median;
   and the host's added work per token on a 248,320-entry row in the current host path
   (unpack the bitset, mask the row). `--constraint-only` runs just this part.
5. The same matcher costs on a synthetic 248,320-id byte-level BPE tokenizer (built here with the
   `tokenizers` library: the 256 byte symbols, then 248K random merges of word-like pieces up to
   24 characters, plus Qwen's special and tag tokens), for the JSON schema above and for a forced
   tool call (tool_choice): the one-time tokenizer and grammar setup, the per-token bitset and
   advance (median and 90th percentile), and the total host time per constrained token: bitset
   + advance + the host path's unpack and mask, or + the device path's copy of the bitset
   (31 KB) into the engine's mask slot.
6. A constrained generation end to end on count_host (the model of part 2: 248,320 logits, the
   demo tokenizer): per streamed token, the wall time of next() with the mask in the device
   sampler (the engine's mask slot: the step committed unsampled, its sampler after the host's
   matcher) and on the host path (the logits row copied, masked and sampled in NumPy), and the
   engine's counters per token. The constraint is the regex "!+x": count_host samples token 0,
   which is "!", so the device path's tokens stay allowed (the host path samples all-zero logits:
   greedy takes "!" too, the filters may end at an "x"); its bitset is cheap, so this is the
   pipelines' own cost (parts 4 and 5 time the matcher).

Timings depend on the machine and its load: they are measurements of this machine, not of a Mac.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import lily_py
from lily_py.backends.engine import REAL_QUANT, checkpoint_activations, engine_spec
from lily_py.config import ModelConfig
from lily_py.resources import demo_path
from lily_py.testing import REAL_TEXT_CONFIG, TINY_TEXT_CONFIG, make_checkpoint

FULL = dict(temperature=0.7, top_k=20, top_p=0.95, min_p=0.05)


def encode_times(repeat: int, position: int = 256) -> None:
    from lily_py import _core
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": dict(REAL_TEXT_CONFIG)})
    spec = engine_spec(cfg, REAL_QUANT, context_length=position + 1, prefill_chunk=1,
                       activations=checkpoint_activations(REAL_QUANT))  # bf16, as load() runs it
    eng = _core.Engine(spec, "count")
    sample = dict(FULL, seed=1, step=1, valid_vocab=cfg.vocab_size)
    for label, kw in (("greedy", {}), ("full sampler", dict(sample=sample, from_slot=False))):
        ns = [eng.count(1, position, False, **kw)["encode_ns"] for _ in range(repeat)]
        st = eng.count(1, position, False, **kw)
        print(f"encode one decode step, real 35B config, context {position}, {label}: "
              f"median {statistics.median(ns) / 1e3:7.1f} us  (min {min(ns) / 1e3:.1f} us; "
              f"{st['dispatches']} dispatches, {st['barriers']} barriers)")


def tiny_real_vocab(folder: str) -> str:
    cfg = dict(TINY_TEXT_CONFIG, vocab_size=REAL_TEXT_CONFIG["vocab_size"], num_hidden_layers=1,
               layer_types=["linear_attention"])
    cfg.pop("full_attention_interval")
    make_checkpoint(folder, cfg, fmt="mlx", seed=0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{demo_path()}/{f}", folder)
    return folder


def timed_tokens(g, after=None) -> list:
    """Wall seconds of each next(g) until the generator ends; after() (if given) runs after each
    token, outside the timed part."""
    walls = []
    while True:
        t0 = time.perf_counter()
        try:
            next(g)
        except StopIteration:
            return walls
        walls.append(time.perf_counter() - t0)
        if after is not None:
            after()


def python_overhead(path: str, n: int) -> None:
    m = lily_py.load(path, backend="count_host", context_length=n + 64, prefill_chunk=16)
    prompt = list(range(100, 116))
    for label, opts in (("greedy", dict(temperature=0.0)), ("temperature+top-k+top-p+min-p", FULL)):
        for rep in range(2):  # the first run warms up
            m.reset()
            g = m.generate(prompt, max_tokens=n, seed=1, **opts)
            next(g)                      # prefill + first token
            encs = []
            t_all = time.perf_counter()
            walls = timed_tokens(g, lambda: encs.append(m.stats().get("encode_ns", 0) * 1e-9))
            t_all = time.perf_counter() - t_all
        k = len(walls)
        over = sorted(w - e for w, e in zip(walls, encs))
        mean_over = (sum(walls) - sum(encs)) / k
        print(f"streamed tokens on count_host, {label}: {k} tokens; per token: wall median "
              f"{statistics.median(walls) * 1e6:6.1f} us, engine encode median "
              f"{statistics.median(encs) * 1e6:6.1f} us, Python overhead (wall - encode) median "
              f"{over[k // 2] * 1e6:6.1f} us, mean {mean_over * 1e6:6.1f} us")


def first_token(path: str) -> None:
    """Host time to the first token. A new prompt each time (prefill + first token sampled on the
    device in the same command buffer); then the same prompt again: the prompt cache restores
    the whole prompt's snapshot, nothing is prefilled, and the device samples the cached logits
    row with the sampler alone (Engine.sample_row; on count_host nothing runs)."""
    m = lily_py.load(path, backend="count_host", context_length=64, prefill_chunk=16)
    for j, (label, opts) in enumerate((("greedy", dict(temperature=0.0)), ("temperature+top-k+top-p+min-p", FULL))):
        for hit in (False, True):
            ts = []
            for i in range(5):
                m.reset()
                prompt = list(range(100, 116)) if hit else list(range(200 + 100 * j + 20 * i, 216 + 100 * j + 20 * i))
                t0 = time.perf_counter()
                g = m.generate(prompt, max_tokens=2, seed=1, **opts)
                next(g)
                ts.append(time.perf_counter() - t0)
                g.close()
            what = "same prompt again (prompt-cache hit: the cached row sampled by the sampler alone)" if hit else "new prompt"
            print(f"time to first token on count_host (host work only), {label}, {what}: "
                  f"median {statistics.median(ts) * 1e3:8.2f} ms")


def constraint_cost(n: int = 200) -> None:
    import json

    import numpy as np

    from lily_py.constraints import Constraint
    from lily_py.sampling import unpack_mask
    from lily_py.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(demo_path())
    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "busy"]},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                                               "inner": {"type": "object", "properties": {"n": {"type": "boolean"}},
                                                         "required": ["n"]}},
              "required": ["mood", "inner"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    answer = tok.encode(json.dumps({"mood": "calm", "tags": ["a", "b", "a"], "inner": {"n": True}},
                                   separators=(",", ":")))
    masks, consumes = [], []
    for _ in range(max(1, n // len(answer))):
        c = Constraint(fmt, tok, tok.token_to_id("<|im_end|>"), tok.vocab_size)
        for t in answer:
            t0 = time.perf_counter()
            c.allowed()
            t1 = time.perf_counter()
            c.consume(t)
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            consumes.append(t2 - t1)
    print(f"constraint (llguidance, demo tokenizer {tok.vocab_size} ids, {len(masks)} tokens): per token "
          f"bitset median {statistics.median(masks) * 1e6:6.1f} us, consume median "
          f"{statistics.median(consumes) * 1e6:6.1f} us")
    v = REAL_TEXT_CONFIG["vocab_size"]
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, -(-v // 32), dtype=np.uint64).astype(np.uint32)
    row = rng.standard_normal(v).astype(np.float32)
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        allowed = unpack_mask(words, v)
        np.where(allowed, row, np.float32(-np.inf))
        ts.append(time.perf_counter() - t0)
    print(f"host path per token at {v} ids: unpack the bitset + mask the row, median "
          f"{statistics.median(ts) * 1e6:8.1f} us")


def constrained_stream(path: str, n: int = 100, timings: bool = True) -> None:
    """Part 6. ``timings=False``: the counters only (deterministic: docs quote them)."""
    m = lily_py.load(path, backend="count_host", context_length=n + 64, prefill_chunk=16,
                     prompt_cache_bytes=0)
    prompt = list(range(100, 116))
    fmt = {"type": "regex", "regex": "!+x"}   # token 0 ("!") always allowed, EOS only after "x"
    runs = (("greedy", dict(temperature=0.0)), ("temperature+top-k+top-p+min-p", FULL))
    for label, opts in runs if timings else runs[:1]:
        for device_masks in (True, False):
            m._device_masks = device_masks
            for _ in range(2 if timings else 1):  # the first run warms up (builds the matcher's tokenizer)
                m.reset()
                eng = m._backend.engine
                g = m.generate(prompt, max_tokens=n, seed=1, response_format=fmt, **opts)
                next(g)                          # prefill + first token
                c0, b0 = dict(eng.counters), eng.logit_bytes_copied
                walls = timed_tokens(g)
            k = len(walls)
            c = {key: (v - c0[key]) / k for key, v in eng.counters.items()}
            b = (eng.logit_bytes_copied - b0) / k
            path_name = "device masks" if device_masks else "host path   "
            wall = f"wall median {statistics.median(walls) * 1e6:7.1f} us; " if timings else ""
            print(f"constrained tokens on count_host, {label}, {path_name}: {k} tokens; per token {wall}"
                  f"{c['commits']:.2f} commits, {c['idle_commits']:.2f} to an idle device, "
                  f"{c['host_waits']:.2f} host waits, {b:,.0f} logit bytes copied")
    m._device_masks = True


def synthetic_tokenizer(n: int = 248_320, seed: int = 0):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``n`` ids (see the module doc, part 5)."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    specials, tags = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>",
                                                                         "<think>", "</think>"]
    toks = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(toks)}
    letters = [vocab[c] for c in toks if c.isascii() and c.isalpha()] + [vocab["\u0120"]]
    merges = []
    rng = np.random.default_rng(seed)
    while len(toks) < n - len(specials) - len(tags):
        lo = 0 if rng.random() < 0.5 else max(0, len(toks) - 5000)
        a = toks[int(rng.integers(lo, len(toks)))]
        b = toks[letters[int(rng.integers(0, len(letters)))]] if rng.random() < 0.8 \
            else toks[int(rng.integers(0, len(toks)))]
        if len(a + b) > 24 or a + b in vocab:
            continue
        vocab[a + b] = len(toks)
        toks.append(a + b)
        merges.append((a, b))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tk.add_tokens(tags)
    return tk


def constraint_cost_real_vocab(n: int = 400) -> None:
    import json

    import numpy as np

    from lily_py.constraints import _llguidance, grammar, tool_call_grammar
    from lily_py.sampling import unpack_mask
    ll = _llguidance()
    t0 = time.perf_counter()
    tk = synthetic_tokenizer()
    t1 = time.perf_counter()
    v = tk.get_vocab_size()
    llt = ll.LLTokenizer(tk.to_str(), n_vocab=v, eos_token=tk.token_to_id("<|im_end|>"))
    t2 = time.perf_counter()
    print(f"synthetic byte-level BPE tokenizer: {v} ids (built in {t1 - t0:.1f} s); llguidance "
          f"LLTokenizer from its JSON: {(t2 - t1) * 1e3:.0f} ms (once per tokenizer)")
    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "busy"]},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                                               "inner": {"type": "object", "properties": {"n": {"type": "boolean"}},
                                                         "required": ["n"]}},
              "required": ["mood", "inner"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
    cases = [("JSON schema", grammar({"type": "json_schema", "json_schema": {"schema": schema}}),
              json.dumps({"mood": "calm", "tags": ["a", "b", "a"], "inner": {"n": True}},
                         separators=(",", ":"))),
             ("forced tool call", ll.LLMatcher.grammar_from_lark(tool_call_grammar(tools, "required", tk)),
              "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, the capital of "
              "France\n</parameter>\n<parameter=days>\n12\n</parameter>\n</function>\n</tool_call>")]
    rng = np.random.default_rng(0)
    row = rng.standard_normal(v).astype(np.float32)
    slot = np.zeros(-(-v // 32), np.uint32)      # stands in for the engine's mask slot
    for label, g, text in cases:
        answer = tk.encode(text).ids
        setup, masks, consumes, hosts, devs = [], [], [], [], []
        for _ in range(max(1, n // len(answer))):
            t0 = time.perf_counter()
            m = ll.LLMatcher(llt, g)
            setup.append(time.perf_counter() - t0)
            for t in answer:
                t0 = time.perf_counter()
                words = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
                t1 = time.perf_counter()
                assert m.consume_token(t), m.get_error()
                t2 = time.perf_counter()
                np.where(unpack_mask(words, v), row, np.float32(-np.inf))
                t3 = time.perf_counter()
                np.copyto(slot, words[:slot.size])
                t4 = time.perf_counter()
                masks.append(t1 - t0)
                consumes.append(t2 - t1)
                hosts.append(t3 - t0)
                devs.append(t2 - t0 + t4 - t3)
        q = lambda xs, p: float(np.percentile(xs, p)) * 1e6  # noqa: E731
        print(f"constraint at {v} ids, {label} ({len(answer)} tokens x {len(masks) // len(answer)}): "
              f"matcher setup median {statistics.median(setup) * 1e3:.2f} ms; per token bitset median "
              f"{q(masks, 50):.1f} us (p90 {q(masks, 90):.1f}), consume median {q(consumes, 50):.1f} us, "
              f"host total: host path (bitset + consume + unpack + mask) median {q(hosts, 50):.0f} us, "
              f"device masks (bitset + consume + copy into the mask slot) median {q(devs, 50):.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--constraint-only", action="store_true")
    ap.add_argument("--constraint-counts", action="store_true",
                    help="part 6's engine counters only (no timings: deterministic)")
    a = ap.parse_args()
    if a.constraint_counts:
        with tempfile.TemporaryDirectory() as d:
            constrained_stream(tiny_real_vocab(d), timings=False)
        return
    if a.constraint_only:
        constraint_cost()
        with tempfile.TemporaryDirectory() as d:
            constrained_stream(tiny_real_vocab(d))
        constraint_cost_real_vocab()
        return
    encode_times(a.repeat)
    with tempfile.TemporaryDirectory() as d:
        path = tiny_real_vocab(d)
        python_overhead(path, a.tokens)
        first_token(path)
        constrained_stream(path)
    constraint_cost()
    constraint_cost_real_vocab()


if __name__ == "__main__":
    main()
