"""Every kernel of the real decode step and of a 4096-token prefill chunk, timed on an NVIDIA GPU
through the cuda device (docs/gpu.md, "Timing"), against a device copy and a streaming read of the
same bytes, and the whole step against its roofline.

    python3 benchmarks/gpu_kernels.py [--layers 40] [--positions 256,4096,32768] [--prefill 4096]
                                      [--repeats 20] [--trials 5] [--json FILE] [--cublas]
                                      [--kv-dtype bfloat16|int8]

Builds a random-weight MLX 4-bit checkpoint of the real Qwen3.6-35B-A3B shapes (``--layers``
of them; the per-layer kernels are the same whatever the count), loads it on ``cuda`` and calls
``Engine.time_step``: each dispatch alone (a CUDA graph of ``--repeats`` launches, ``--trials``
times, median), the whole step as the engine records it (one graph of its levels), and an empty
graph of the same levels and node counts. Per kernel it prints bytes touched, µs, GB/s and the
ratio to a device copy (``copy``) and to a streaming read (``read``) of the same bytes; for the
prefill chunk also TFLOP/s, and with ``--cublas`` PyTorch's bf16 GEMM of the same shapes.

Needs a CUDA build (``-Ccmake.define.LILY_CUDA=ON``) and an NVIDIA GPU; numbers are the GPU's,
not a Mac's (docs/gpu.md, "What it says and does not say about a Mac").
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict

GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0, "step": 0, "valid_vocab": 0}


def by_kernel(dispatches):
    """{kernel: dict(n, bytes, us, copy_us, read_us, flops)} over a step's dispatches."""
    out = defaultdict(lambda: dict(n=0, bytes=0, us=0.0, copy_us=0.0, read_us=0.0, flops=0, groups=None))
    for d in dispatches:
        k = out[d["kernel"]]
        k["n"] += 1
        k["bytes"] += d["bytes_touched"]
        k["us"] += d["us"]
        k["copy_us"] += d["copy_us"]
        k["read_us"] += d["read_us"]
        k["flops"] += d["flops_useful"]
        k["groups"] = k["groups"] or d["groups"]
        k["max_bytes"] = max(k.get("max_bytes", 0), d["bytes_touched"])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def kernel_table(title, dispatches, flops=False):
    rows = by_kernel(dispatches)
    print(f"\n{title}")
    head = f"{'kernel':34} {'n':>4} {'MB/disp':>8} {'us/disp':>8} {'GB/s':>7} {'/copy':>6} {'/read':>6} {'share':>6}"
    if flops:
        head += f" {'TFLOP/s':>8}"
    print(head)
    total = sum(r["us"] for r in rows.values()) or 1.0
    for name, r in rows.items():
        n = r["n"]
        line = (f"{name:34} {n:4d} {r['bytes'] / n / 1e6:8.2f} {r['us'] / n:8.2f} "
                f"{r['bytes'] / (r['us'] * 1e3):7.0f} {r['copy_us'] / r['us']:6.2f} {r['read_us'] / r['us']:6.2f} "
                f"{r['us'] / total:6.1%}")
        if flops:
            line += f" {r['flops'] / (r['us'] * 1e6):8.1f}"
        print(line)
    return rows


def step_line(label, t, copy_gbps):
    ds = t["dispatches"]
    touched = sum(d["bytes_touched"] for d in ds)
    roof = touched / (copy_gbps * 1e3)            # µs at the measured copy bandwidth
    summed = sum(d["us"] for d in ds)
    print(f"{label:22} step {t['step_us']:9.1f} us (min {t['step_us_min']:.1f})  levels {t['levels']:4d}  "
          f"nodes {t['nodes']:4d}  empty graph {t['empty_us']:7.1f} us  sum of kernels {summed:9.1f} us  "
          f"bytes {touched / 1e6:8.1f} MB  roofline {roof:8.1f} us  step/roofline {roof / t['step_us']:5.2f}")
    return dict(label=label, step_us=t["step_us"], empty_us=t["empty_us"], levels=t["levels"],
                nodes=t["nodes"], sum_us=summed, bytes=touched, roofline_us=roof)


def cublas(shapes, trials):
    """µs and TFLOP/s of torch.matmul bf16 [M, K] @ [K, N] for each (M, N, K)."""
    import torch
    out = {}
    for (M, N, K) in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                a @ b
        us = []
        for _ in range(trials):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            us.append(s.elapsed_time(e) * 1e3 / 10)
        us.sort()
        out[(M, N, K)] = us[len(us) // 2]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--positions", default="256,4096,32768")
    ap.add_argument("--prefill", type=int, default=4096, help="prefill chunk timed at position 0 (0: none)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cublas", action="store_true", help="time torch bf16 GEMMs of the prefill shapes")
    ap.add_argument("--model", default=None, help="a checkpoint instead of random weights")
    ap.add_argument("--kv-dtype", default=None, choices=["bfloat16", "int8", "float32"],
                    help="the KV cache's dtype (load(kv_dtype=...); default: the engine's, bfloat16)")
    a = ap.parse_args(argv)

    import lily_py
    from lily_py.testing import make_checkpoint
    from lily_py.tools.bench import _config_dict

    positions = [int(p) for p in a.positions.split(",") if p]
    info = lily_py.device_info("cuda")
    print(f"gpu_kernels: {info.get('device_name')} ({info.get('gpu_family')}), lily_py {lily_py.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, {platform.node()}")
    print("command: python3 benchmarks/gpu_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    tmp = None
    path = a.model
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="lily_gpu_")
        t0 = time.time()
        path = make_checkpoint(tmp.name, _config_dict("real", a.layers), fmt="mlx", seed=0)
        print(f"random-weight checkpoint, real shapes, {a.layers} layers: {time.time() - t0:.1f} s")
    ctx = max(positions + [a.prefill]) + 8
    t0 = time.time()
    m = lily_py.load(path, backend="cuda", context_length=ctx, prefill_chunk=max(a.prefill, 1), verbose=False,
                     kv_dtype=a.kv_dtype)
    print(f"loaded on cuda in {time.time() - t0:.1f} s")
    e = m._backend.engine
    print(f"KV cache: {m.kv_dtype}")
    result = {"device": info.get("device_name"), "layers": a.layers, "kv_dtype": m.kv_dtype,
              "date": time.strftime("%Y-%m-%d"), "decode": [], "prefill": None}
    copy_gbps = None
    for i, pos in enumerate(positions):
        t = e.time_step(1, pos, sample=GREEDY, repeats=a.repeats, trials=a.trials)
        copy_gbps = copy_gbps or t["copy_gbps"]
        if i == 0:
            print(f"references (1 GiB): device copy {t['copy_gbps']:.0f} GB/s (read + write), "
                  f"streaming read {t['read_gbps']:.0f} GB/s")
            print("\ndecode steps (greedy sampling included), one CUDA graph each:")
        row = step_line(f"decode at {pos}", t, copy_gbps)
        row["kernels"] = by_kernel(t["dispatches"])
        row["dispatches"] = t["dispatches"]
        result["decode"].append(row)
    for row in result["decode"]:
        kernel_table(f"decode at {row['label'].split()[-1]}: per kernel (us/disp: median of {a.trials} graphs of "
                     f"{a.repeats} launches)", row["dispatches"])
    if a.prefill:
        t = e.time_step(a.prefill, 0, repeats=max(2, a.repeats // 5), trials=a.trials)
        print()
        row = step_line(f"prefill {a.prefill} at 0", t, copy_gbps)
        rows = kernel_table(f"prefill chunk of {a.prefill}: per kernel", t["dispatches"], flops=True)
        flops = sum(d["flops_useful"] for d in t["dispatches"])
        print(f"prefill chunk: {flops / 1e12:.2f} TFLOP useful, {flops / (t['step_us'] * 1e6):.1f} TFLOP/s over the step, "
              f"{a.prefill / (t['step_us'] * 1e-6):.0f} tok/s")
        row["kernels"] = rows
        result["prefill"] = row
        if a.cublas:
            try:
                cfg = m._backend.cfg
                H = cfg.hidden_size
                shapes = sorted({(a.prefill, H, H), (a.prefill, cfg.vocab_size, H)})
                for (M, N, K), us in cublas(shapes, a.trials).items():
                    print(f"cuBLAS bf16 {M}x{N}x{K}: {us:9.1f} us, {2 * M * N * K / (us * 1e6):6.1f} TFLOP/s")
            except Exception as ex:  # torch missing: say so
                print(f"cuBLAS comparison skipped: {type(ex).__name__}: {ex}")
    if a.json:
        for row in result["decode"]:
            row.pop("dispatches", None)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
