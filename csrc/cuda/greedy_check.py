"""Greedy tokens of the engine on one backend against another (default: cuda vs reference).

    python3 csrc/cuda/greedy_check.py [--backend cuda] [--against reference] [--tokens 32]
                                      [--chunks 1,64,4096] [--model PATH]

Loads the checkpoint (default: the bundled demo) on both backends, generates --tokens greedy
tokens from the same prompt for each prefill chunk size, prints both token lists and exits
non-zero when they differ.
"""
import argparse
import sys

import lily_py


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--against", default="reference")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--chunks", default="1,64,4096")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. Then it")
    a = ap.parse_args()
    bad = 0
    ref = lily_py.load(a.model, backend=a.against, context_length=512)
    want = ref.generate_text(a.prompt, max_tokens=a.tokens, temperature=0.0).tokens
    print(f"{a.against}: {want}")
    for chunk in [int(c) for c in a.chunks.split(",")]:
        m = lily_py.load(a.model, backend=a.backend, context_length=512, prefill_chunk=chunk)
        got = m.generate_text(a.prompt, max_tokens=a.tokens, temperature=0.0).tokens
        same = got == want
        bad += not same
        print(f"{a.backend} prefill_chunk={chunk}: {'equal' if same else 'DIFFERENT'} {got}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
