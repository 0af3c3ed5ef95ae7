"""Static instruction counts of kernels from their generated code (cuobjdump -sass), by class.

    python3 tools/gpu/sass_count.py CUBIN_DIR KERNEL [KERNEL ...]

CUBIN_DIR: the output of csrc/cuda/nvrtc_build.py (its manifest.txt maps host names to cubin
entries). Needs cuobjdump and nvdisasm on PATH (the CUDA toolkit, or the pip packages
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm: no GPU needed). Prints per kernel the static
instruction count and its global loads by width, FP32 arithmetic, shuffles, conversions and
local-memory (stack) accesses. Static counts say what the code is; instructions executed per byte
(tools/gpu/ncu_decode.py, Nsight Compute) say what it does.
"""
import os
import re
import subprocess
import sys
from collections import Counter

CLASSES = [
    ("LDG.128", r"^LDG\.E\.(128|ENL2\.128)"), ("LDG.64", r"^LDG\.E\.64"), ("LDG<=32", r"^LDG"),
    ("LDS", r"^LDS"), ("STS", r"^STS"), ("STG", r"^STG"), ("local", r"^(LDL|STL)"),
    ("FFMA", r"^FFMA"), ("FMUL", r"^FMUL"), ("FADD", r"^FADD"), ("MUFU", r"^MUFU"),
    ("SHFL", r"^SHFL"), ("convert", r"^(F2F|I2F|F2I|I2FP|F2FP)"), ("LOP3", r"^LOP3"), ("IMAD/IADD", r"^(IMAD|IADD)"),
    ("branch", r"^(BRA|BSSY|BSYNC|WARPSYNC)"), ("BAR", r"^BAR"),
]


def count(cubin, entry):
    text = subprocess.run(["cuobjdump", "-sass", "-fun", entry, cubin], capture_output=True, text=True, check=True).stdout
    ops = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m and m.group(1) != "NOP":
            ops.append(m.group(1))
    c = Counter()
    for op in ops:
        for name, pat in CLASSES:
            if re.match(pat, op):
                c[name] += 1
                break
    c["total"] = len(ops)
    return c


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    d, names = argv[0], argv[1:]
    where = {}
    for line in open(os.path.join(d, "manifest.txt")):
        cubin, entry, host = line.split()
        where[host] = (os.path.join(d, cubin), entry)
    cols = ["total"] + [n for n, _ in CLASSES]
    print(f"{'kernel':36} " + " ".join(f"{c:>9}" for c in cols))
    for n in names:
        if n not in where:
            sys.exit(f"sass_count: no kernel {n!r} in {d}/manifest.txt")
        c = count(*where[n])
        print(f"{n:36} " + " ".join(f"{c[k]:9d}" for k in cols))


if __name__ == "__main__":
    main(sys.argv[1:])
