"""xgrammar vs llguidance (not a test): the per-token mask time of the same grammars on the
synthetic 248,320-id byte-level BPE tokenizer of benchmarks/host_overhead.py (part 5).

    pip install xgrammar torch transformers   # this benchmark only: never a lily_py dependency
    python benchmarks/xgrammar_compare.py [--rounds 5]

For each library: the one-time tokenizer setup (llguidance: ``LLTokenizer`` from the tokenizer's
JSON; xgrammar: ``TokenizerInfo.from_huggingface`` over a ``transformers`` wrapper of the same
``tokenizers`` tokenizer), the grammar compile, and along a fixed answer the per-token bitset
(median, 90th percentile) and advance; then how many tokens' bitsets differ between the two.
Grammars: the nested JSON schema of host_overhead.py, compact (no free whitespace; llguidance as
lily_py compiles it, xgrammar with ``any_whitespace=False`` and separators "," ":"), and a regex.
Both libraries fill the same layout (bit i % 32 of uint32 word i / 32).

Timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_overhead import synthetic_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["calm", "busy"]},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                                           "inner": {"type": "object", "properties": {"n": {"type": "boolean"}},
                                                     "required": ["n"]}},
          "required": ["mood", "inner"], "additionalProperties": False}
ANSWER = json.dumps({"mood": "calm", "tags": ["a", "b", "a"], "inner": {"n": True}}, separators=(",", ":"))
REGEX, REGEX_ANSWER = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]", "2026-12-03T17:45"


def q(xs, p: float) -> float:
    return float(np.percentile(xs, p)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="answers replayed per grammar")
    a = ap.parse_args()
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        raise SystemExit(f"xgrammar_compare: needs xgrammar (and its torch, transformers): {e}")
    from lily_py.constraints import _JSON_DEFAULTS, _llguidance
    ll = _llguidance()

    tk = synthetic_tokenizer()
    v = tk.get_vocab_size()
    eos = tk.token_to_id("<|im_end|>")
    t0 = time.perf_counter()
    llt = ll.LLTokenizer(tk.to_str(), n_vocab=v, eos_token=eos)
    t1 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tk), vocab_size=v,
                                              stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t2 = time.perf_counter()
    print(f"synthetic byte-level BPE tokenizer, {v} ids; tokenizer setup: llguidance {(t1 - t0) * 1e3:.0f} ms, "
          f"xgrammar {(t2 - t1) * 1e3:.0f} ms (once per tokenizer)")

    cases = [("JSON schema", ll.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=_JSON_DEFAULTS),
              lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")),
              ANSWER),
             ("regex", ll.LLMatcher.grammar_from_regex(REGEX), lambda: compiler.compile_regex(REGEX), REGEX_ANSWER)]
    words = -(-v // 32)
    for label, ll_grammar, xgr_compile, text in cases:
        answer = tk.encode(text).ids
        t0 = time.perf_counter()
        compiled = xgr_compile()
        xgr_setup = time.perf_counter() - t0
        ll_setup, ll_mask, ll_adv, x_setup, x_mask, x_adv = [], [], [], [], [], []
        differ = 0
        for r in range(a.rounds):
            t0 = time.perf_counter()
            m = ll.LLMatcher(llt, ll_grammar)
            t1 = time.perf_counter()
            xm = xgr.GrammarMatcher(compiled)
            t2 = time.perf_counter()
            ll_setup.append(t1 - t0)
            x_setup.append(t2 - t1)
            xbits = np.zeros((1, words), np.int32)
            for t in answer:
                t0 = time.perf_counter()
                lw = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)[:words]
                t1 = time.perf_counter()
                assert m.consume_token(t), m.get_error()
                t2 = time.perf_counter()
                xm.fill_next_token_bitmask(xbits)
                t3 = time.perf_counter()
                assert xm.accept_token(t), f"xgrammar rejects token {t} of the answer"
                t4 = time.perf_counter()
                ll_mask.append(t1 - t0)
                ll_adv.append(t2 - t1)
                x_mask.append(t3 - t2)
                x_adv.append(t4 - t3)
                if r == 0:
                    differ += int(not np.array_equal(lw, xbits[0].view(np.uint32)))
        print(f"{label} ({len(answer)} tokens x {a.rounds}): compile: xgrammar {xgr_setup * 1e3:.1f} ms, "
              f"then a matcher each: llguidance {statistics.median(ll_setup) * 1e3:.2f} ms (it compiles "
              f"here), xgrammar {statistics.median(x_setup) * 1e3:.2f} ms")
        print(f"  per token bitset: llguidance median {q(ll_mask, 50):.1f} us (p90 {q(ll_mask, 90):.1f}), "
              f"xgrammar median {q(x_mask, 50):.1f} us (p90 {q(x_mask, 90):.1f}); advance: llguidance "
              f"{q(ll_adv, 50):.1f} us, xgrammar {q(x_adv, 50):.1f} us; bitsets that differ: "
              f"{differ} of {len(answer)}")


if __name__ == "__main__":
    main()
