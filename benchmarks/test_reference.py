"""Reference-backend speed: demo checkpoint, and the real model's per-layer shapes (2 layers)."""
import numpy as np
import pytest

import lily_py
from lily_py.testing import REAL_TEXT_CONFIG, make_checkpoint


@pytest.fixture(scope="module")
def demo():
    return lily_py.load(backend="reference")


def test_demo_decode(benchmark, demo):
    demo.reset()
    demo.prefill(demo.tokenizer.encode("In the beginning God created"))
    benchmark(lambda: demo.decode(5))
    print(f"\ndemo decode: {1 / benchmark.stats['mean']:.1f} tok/s (reference backend)")


def test_demo_prefill_64(benchmark, demo):
    ids = np.random.default_rng(0).integers(0, demo.tokenizer.vocab_size, 64)

    def run():
        demo.reset()
        demo.prefill(ids)
    benchmark(run)
    print(f"\ndemo prefill: {64 / benchmark.stats['mean']:.1f} tok/s (reference backend)")


@pytest.fixture(scope="module")
def real2(tmp_path_factory):
    cfg = dict(REAL_TEXT_CONFIG, num_hidden_layers=2,
               layer_types=["linear_attention", "full_attention"])
    path = make_checkpoint(tmp_path_factory.mktemp("real2"), cfg, fmt="mlx", std=0.02)
    return lily_py.load(path, backend="reference")


def test_real_shapes_decode(benchmark, real2):
    real2.reset()
    real2.prefill([1, 2, 3])
    benchmark.pedantic(lambda: real2.decode(7), rounds=3, iterations=1)
    print(f"\nreal shapes, 2 layers + embedding + lm_head: {benchmark.stats['mean']:.2f} s per "
          f"decoded token (reference backend; {real2.weights.nbytes() / 1e9:.2f} GB mapped)")
