"""Precision study of int8 activations on the M5 path's tensor-op matmuls (built as the opt-in since 2026-12-02).

Go / no-go question: if x were quantized to int8 (symmetric, one scale = max |x| / 127 per row and
per group of G along K) at the input of every quantized matmul of the prompt, would the logits still
be within mlx-lm's own bf16 error of the fp32 oracle (issue 11's precision criterion)? Measured on the
NumPy reference (float32 everywhere else, so this is int8's error alone; the engine's bf16 roundings
add to it) for the oracle checkpoints that have mlx-lm's bf16 run (tests/fixtures/oracles; the same
cases as tests/model/test_bf16_activations.py): the prompt's logits with int8 x, then 32 decode steps
fed the oracle's greedy tokens (decode stays unquantized: it runs the matvec kernels). Prints
max_rel = max |d| / max |ref| and nmse = sum d^2 / sum ref^2, as that test does, beside mlx-lm's.

    python benchmarks/int8_activation_study.py [--group 32 64]     (seconds)
    python benchmarks/int8_activation_study.py --engine             (about 1 minute)
    python benchmarks/int8_activation_study.py --outliers           (seconds)
    python benchmarks/int8_activation_study.py --residual 5 4 3.5   (seconds)

``--engine``: the built opt-in instead (qmm_m5i8, int8 x per 32 columns on the projections; the MoE
64-row tiles moe_*_m5i8, which these prompts of 13-23 tokens never fill: their MoE tiles are 32-row
and smaller, on half operands), on the engine with bf16 activations on a simulated M5, beside the
same engine without it: the numbers test_bf16_activations.py asserts for the M5 path.

``--outliers``: whether the checkpoints' activations have outliers that stretch an int8 scale: per
prompt position, the largest max|x| / rms(x) over the 32-column groups of every quantized matmul's
input (sqrt(32) = 5.66 is the most a group can have: one value and 31 zeros; Gaussian groups sit
near 2.5-3.5; the massive activations of trained LLMs give tens to hundreds).

``--residual TAU ...``: a variant not built, to see whether handling such groups lowers the error:
int8 x per 32 columns as above, plus, for every group whose max|x| > TAU rms(x), a second int8 pass
on its rounding residual (scale s / 254: about 15 bits for that group); prints the share of groups
that take it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import lily_py
from lily_py import weights as lw
from lily_py.reference.kernels import int8_rows

ORACLES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "oracles"
CASES = ("std4_nested_fused", "bf16_flat_mha_top3", "bf16_h128_gqa3_top2", "bf16_top1_gqa4")


def int8_roundtrip(x: np.ndarray, group: int) -> np.ndarray:
    """x quantized to int8 per row and per `group` columns as qmm_m5i8 does
    (lily_py.reference.kernels.int8_rows; one group per row where K is not a multiple of it) and
    back to float32."""
    K = np.shape(x)[-1]
    g = group if K % group == 0 else K
    codes, s = int8_rows(x, g)
    return (codes * np.repeat(s, g, axis=-1)).astype(np.float32)


def int8_residual_roundtrip(x: np.ndarray, group: int, tau: float, flagged: list) -> np.ndarray:
    """int8_roundtrip plus, for groups with max|x| > tau rms(x), their int8-quantized residual."""
    x = np.asarray(x, np.float32)
    K = x.shape[-1]
    g = group if K % group == 0 else K
    codes, s = int8_rows(x, g)
    xs = x.reshape(x.shape[:-1] + (K // g, g)).astype(np.float64)
    deq = codes.reshape(xs.shape) * s[..., None]
    flag = np.abs(xs).max(-1, keepdims=True) > tau * np.sqrt((xs * xs).mean(-1, keepdims=True))
    s2 = s[..., None] / 254.0
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(s2 > 0, np.clip(np.rint((xs - deq) / s2), -127, 127), 0)
    flagged.append(float(flag.mean()))
    return (deq + np.where(flag, r * s2, 0)).reshape(x.shape).astype(np.float32)


def errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    g, r = got.astype(np.float64), ref.astype(np.float64)
    return float(np.abs(g - r).max() / np.abs(r).max()), float(((g - r) ** 2).sum() / (r ** 2).sum())


def decode_and_compare(be, exp, pre: np.ndarray) -> dict:
    """32 decode steps fed the oracle's greedy tokens after the prompt's logits `pre`; errors of the
    prompt's and of all rows against the fp32 oracle, and whether every step's argmax is its token."""
    tokens = exp["mlx_bf16_greedy"]
    steps = np.stack([pre[-1]] + [be.forward(np.array([t], np.uint32), all_logits=False) for t in tokens[:-1]])
    ref_pre, ref_steps = exp["mlx_bf16_logits"], exp["mlx_bf16_greedy_logits"]
    return {"prefill": errors(pre, ref_pre),
            "all": errors(np.concatenate([pre, steps]), np.concatenate([ref_pre, ref_steps])),
            "greedy": bool((steps.argmax(1) == tokens).all())}


def prompt_forward(name: str, transform=None):
    """The reference backend of checkpoint `name`, its oracle fixture and the prompt's logits, with
    every quantized matmul's input (the tensor-op route's) passed through transform(x) first (None:
    unchanged); decode steps afterwards run unchanged."""
    exp = np.load(ORACLES / name / "expected.npz")
    be, plain = lily_py.load(str(ORACLES / name / "mlx4_bf16"), backend="reference",
                                kv_dtype="bfloat16")._backend, lw.Linear.matmul

    def matmul(self, x):
        return plain(self, transform(x) if self.bits is not None else x)

    if transform is not None:
        lw.Linear.matmul = matmul
    try:
        pre = be.forward(exp["prompt"].astype(np.uint32), all_logits=True)
    finally:
        lw.Linear.matmul = plain
    return be, exp, pre


def run(name: str, group: int | None, tau: float | None = None, flagged: list | None = None) -> dict:
    """Errors against the fp32 oracle: the reference with int8 x on the prompt (group None: none;
    tau: with int8_residual_roundtrip)."""
    transform = None if group is None else (lambda x: int8_roundtrip(x, group)) if tau is None else \
        (lambda x: int8_residual_roundtrip(x, group, tau, flagged))
    return decode_and_compare(*prompt_forward(name, transform))


def run_engine(name: str, int8: bool) -> dict:
    """The engine (emu, bf16 activations) on a simulated M5, with or without the int8 opt-in."""
    from lily_py.testing import simulated_device
    exp = np.load(ORACLES / name / "expected.npz")
    with simulated_device(tensor_ops=True, tensor_int8=int8):
        # the bf16 KV cache: the study isolates int8 x
        be = lily_py.load(str(ORACLES / name / "mlx4_bf16"), backend="emu", context_length=128,
                          kv_dtype="bfloat16")._backend
    pre = be.forward(exp["prompt"].astype(np.uint32), all_logits=True)
    return decode_and_compare(be, exp, pre)


def outliers(name: str) -> dict:
    """Per input width K: [calls, T] the largest group max|x| / rms(x) of each prompt row."""
    seen: dict = {}
    T = len(np.load(ORACLES / name / "expected.npz")["prompt"])

    def record(x):  # the inputs of all T prompt rows (not the experts' routed subsets)
        if x.ndim != 2 or x.shape[0] != T:
            return x
        K = x.shape[-1]
        g = 32 if K % 32 == 0 else K
        a = np.abs(np.asarray(x, np.float64)).reshape(x.shape[0], K // g, g)
        rms = np.sqrt((a * a).mean(-1))
        seen.setdefault(K, []).append(np.where(rms > 0, a.max(-1) / np.where(rms > 0, rms, 1), 0).max(-1))
        return x

    prompt_forward(name, record)
    return {K: np.stack(v) for K, v in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", type=int, nargs="+", default=[32, 64], help="int8 scale group sizes along K")
    ap.add_argument("--engine", action="store_true", help="the built opt-in on the engine (simulated M5)")
    ap.add_argument("--outliers", action="store_true", help="group max/rms of the matmul inputs per position")
    ap.add_argument("--residual", type=float, nargs="+", metavar="TAU",
                    help="also int8 the residual of groups with max > TAU rms (group 32; not built)")
    args = ap.parse_args()
    if args.outliers:
        print("largest max|x| / rms(x) over the 32-column groups of the prompt's quantized-matmul inputs, per "
              "input width K (number of matmuls), per prompt position")
        for name in CASES:
            for K, r in sorted(outliers(name).items()):
                print(f"{name:20} K {K:4d} ({len(r):2d})  " + " ".join(f"{v:.1f}" for v in r.max(0)))
        return
    if args.residual:
        print("int8 x per 32 columns + an int8 pass on the residual of groups with max|x| > TAU rms(x) (NumPy "
              "reference, not built) vs mlx-lm bf16; errors against the fp32 oracle, max_rel / nmse")
        for name in CASES:
            exp = np.load(ORACLES / name / "expected.npz")
            mlx_pre = errors(exp["mlxbf16_bf16_logits"], exp["mlx_bf16_logits"])
            print(f"{name:20} {'mlx-lm bf16':<18} prefill {mlx_pre[0]:.3e} / {mlx_pre[1]:.3e}")
            for tau in args.residual:
                flagged: list = []
                r = run(name, 32, tau, flagged)
                print(f"{'':20} {'TAU ' + format(tau, 'g'):<18} prefill {r['prefill'][0]:.3e} / {r['prefill'][1]:.3e}"
                      f"   groups with a residual pass {np.mean(flagged):.1%}")
        return
    if args.engine:
        print("engine, bf16 activations, simulated M5, without / with the int8 opt-in (qmm_m5i8, moe_*_m5i8) vs mlx-lm bf16;"
              " errors against the fp32 oracle, max_rel / nmse")
    else:
        print("int8 x at every quantized matmul of the prompt (NumPy reference, fp32 otherwise) vs mlx-lm bf16;"
              " errors against the fp32 oracle, max_rel / nmse")
    for name in CASES:
        exp = np.load(ORACLES / name / "expected.npz")
        ref = np.concatenate([exp["mlx_bf16_logits"], exp["mlx_bf16_greedy_logits"]])
        mlx = errors(np.concatenate([exp["mlxbf16_bf16_logits"], exp["mlxbf16_bf16_greedy_logits"]]), ref)
        mlx_pre = errors(exp["mlxbf16_bf16_logits"], exp["mlx_bf16_logits"])
        print(f"{name:20} {'mlx-lm bf16':<18} prefill {mlx_pre[0]:.3e} / {mlx_pre[1]:.3e}   all {mlx[0]:.3e} / {mlx[1]:.3e}")
        for g in ([None, "int8"] if args.engine else args.group):
            r = run_engine(name, g == "int8") if args.engine else run(name, g)
            ok = r["all"][0] <= mlx[0] and r["all"][1] <= mlx[1] and r["prefill"][1] <= mlx_pre[1]
            label = ("engine " + ("int8 opt-in" if g else "M5 path")) if args.engine else f"int8 x, group {g}"
            print(f"{'':20} {label:<18} prefill {r['prefill'][0]:.3e} / {r['prefill'][1]:.3e}   all "
                  f"{r['all'][0]:.3e} / {r['all'][1]:.3e}   greedy 32: {r['greedy']}   "
                  f"{'within' if ok else 'NOT within'} mlx-lm's")


if __name__ == "__main__":
    main()
