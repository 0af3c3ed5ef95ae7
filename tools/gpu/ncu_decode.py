"""Nsight Compute's counters for every kernel of one decode step (docs/gpu.md, "Counters").

    ncu --clock-control none --profile-from-start off --csv --log-file OUT.csv \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
l1tex__throughput.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active,\
smsp__inst_executed.sum,dram__bytes_read.sum \
        python3 tools/gpu/ncu_decode.py run CKPT POSITION [BATCH]
    python3 tools/gpu/ncu_decode.py table OUT.csv

``run`` loads CKPT on cuda with serial launches (LILY_CUDA_GRAPHS=0, so ncu sees each kernel),
then profiles exactly one greedy decode step (cuProfilerStart/Stop around it): of one sequence,
or with BATCH > 1 the batched step of BATCH sequences. ``table`` maps the cubin entries to host
names (the installed manifest.txt) and prints per kernel: launches, µs, DRAM, L1/TEX and issue-slot utilisation (% of peak), and the
warp instructions executed per KiB read from DRAM (ncu flushes the caches before each launch, so
DRAM bytes read are the bytes the kernel touches once): the generated code's instructions per byte.
"""
import csv
import ctypes
import os
import sys
from collections import defaultdict

METRICS = {"gpu__time_duration.sum": "us", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram",
           "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1tex",
           "sm__inst_issued.avg.pct_of_peak_sustained_active": "issue",
           "smsp__inst_executed.sum": "inst", "dram__bytes_read.sum": "read"}
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def run(ckpt, position, batch=1):
    os.environ["LILY_CUDA_GRAPHS"] = "0"
    import lily_py
    m = lily_py.load(ckpt, backend="cuda", context_length=position + 16, prefill_chunk=max(8, batch), verbose=False)
    e = m._backend.engine  # the step at POSITION over whatever the cache holds: only time counts
    cuda = ctypes.CDLL("libcuda.so.1")
    g = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0, valid_vocab=0)
    step = (lambda **kw: e.time_step(1, position, sample=g, **kw)) if batch == 1 else (
        lambda **kw: e.time_batch(batch, position, **kw))  # the batch's own greedy rows
    step(repeats=1, trials=1)  # warm: every pipeline once
    cuda.cuProfilerStart()
    step(repeats=1, trials=1, per_dispatch=False)
    cuda.cuProfilerStop()


def manifest():
    """{cubin entry: host name}: $LILY_CUDA_MANIFEST, else the installed cuda_kernels/manifest.txt."""
    import lily_py
    path = os.environ.get("LILY_CUDA_MANIFEST") or os.path.join(
        os.path.dirname(lily_py.__file__), "cuda_kernels", "manifest.txt")
    names = {}
    for line in open(path):
        _cubin, entry, host = line.split()
        names[entry] = host
    return names


def table(path):
    names = manifest()
    rows = defaultdict(lambda: defaultdict(list))
    text = open(path).read()
    lines = text[text.index('"ID"'):].splitlines()
    for r in csv.DictReader(lines):
        key = METRICS.get(r.get("Metric Name"))
        if key is None:
            continue
        name = r["Kernel Name"].split("(")[0]
        v = float(r["Metric Value"].replace(",", ""))
        if key == "us":
            v *= {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(r.get("Metric Unit"), 1.0)
        elif key == "read":
            v *= UNITS.get(r.get("Metric Unit"), 1.0)
        rows[names.get(name, name)][key].append(v)
    print(f"{'kernel':40} {'n':>3} {'us':>8} {'DRAM%':>6} {'L1TEX%':>7} {'issue%':>7} {'MB read':>8} {'inst/KiB':>8}")
    for k, d in sorted(rows.items(), key=lambda kv: -sum(kv[1]["us"])):
        n = len(d["us"])
        avg = lambda x: sum(d[x]) / max(len(d[x]), 1)
        per_kib = avg('inst') / avg('read') * 1024 if d["read"] and avg('read') > 0 else float("nan")
        print(f"{k:40} {n:3d} {avg('us'):8.1f} {avg('dram'):6.1f} {avg('l1tex'):7.1f} {avg('issue'):7.1f} "
              f"{avg('read') / 1e6:8.2f} {per_kib:8.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    else:
        table(sys.argv[2])
