"""Compile shaders/*.metal as CUDA with NVRTC into cubins (the cuda device's kernel modules).

    python3 csrc/cuda/nvrtc_build.py --out DIR [--arch sm_90] [--check-ids] [-j N]

One NVRTC program per shader file (NVRTC has no __COUNTER__: entries are named by file index
and line), written as DIR/<index>_<name>.cubin with DIR/manifest.txt (cubin, entry, host name
per line), which the cuda device (csrc/cuda/cuda_device.cpp) reads.

The shaders compile unchanged: csrc/cuda/metal_cuda.h maps the MSL subset to CUDA and NVRTC's
-default-device makes the shaders' unannotated functions device functions (nvcc has no such
option). NVRTC is found at $LILY_NVRTC, in the pip package nvidia-cuda-nvrtc (nvidia/cu13/lib),
or under $CUDA_HOME/lib64; none found is an error, never a silent pass. The NVRTC must be no
newer than the driver that loads the cubin (a cubin from NVRTC 13.0 for sm_90 loads on 580).

After compiling, the cubin's ELF is read back: every LILY_INSTANTIATE entry (lily_kernel_<n>) and
its host name; with --check-ids, every id of csrc/gpu/kernel_ids.h must be present once, and
each entry's static shared memory (.nv.shared.<entry>) must stay within Apple's 32 KiB.
"""
import argparse
import ctypes
import glob
import os
import re
import struct
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHADERS = [
    "attention.metal", "attention_decode.metal", "attention_prefill.metal", "elementwise.metal",
    "embedding.metal", "gated_delta.metal", "gated_delta_chunk.metal", "moe_plan.metal",
    "moe_decode.metal", "moe_prefill.metal", "moe_prefill_bf16.metal", "norm.metal", "qmm.metal",
    "m5/qmm_m5.metal", "m5/moe_m5.metal", "m5/attention_m5.metal", "m5/gated_delta_chunk_m5.metal",
    "sampling.metal", "sampling_buckets.metal", "sampling_logprobs.metal",
]
TOOLS = -1  # the job index of csrc/cuda/tools.cu (the device's own timing kernels)
TOOL_ENTRIES = ["lily_cuda_empty", "lily_cuda_stream_read"]
APPLE_STATIC_TG_LIMIT = 32 * 1024


def find_nvrtc():
    cands = []
    if os.environ.get("LILY_NVRTC"):
        cands.append(os.environ["LILY_NVRTC"])
    for p in sys.path:
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "cu1*", "lib", "libnvrtc.so.*")))
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
            cands += sorted(glob.glob(os.path.join(home, "targets", "*", "lib", "libnvrtc.so*")))
    cands += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    errors = []
    for c in cands:
        if "builtins" in c or ".alt." in c:
            continue
        try:
            # libnvrtc dlopens its builtins by name: load them first from the same folder.
            for b in sorted(glob.glob(os.path.join(os.path.dirname(c), "libnvrtc-builtins.so.*"))):
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(c), c
        except OSError as e:
            errors.append(f"{c}: {e}")
    raise SystemExit("nvrtc_build: no NVRTC library found (set LILY_NVRTC, or pip install "
                     "nvidia-cuda-nvrtc no newer than the driver); tried:\n  " + "\n  ".join(errors))


def compile_cubin(lib, arch, index, usage=False):
    if index == TOOLS:
        return compile_source(lib, arch, open(os.path.join(ROOT, "csrc", "cuda", "tools.cu")).read(),
                              "tools.cu", [f"-arch={arch}", "-std=c++20", "-lineinfo"])
    src = f'#include "cuda/metal_cuda.h"\n#include "{SHADERS[index]}"\n'
    # -fmad=false: no multiply-add contraction, as the emulator (-ffp-contract=off) and the
    # Metal library's safe math; with contraction, embedding's s * q + b differs by 1 ulp.
    opts = [f"-arch={arch}", "-default-device", "-std=c++20", "-fmad=false", "-DLILY_CUDA=1",
            f"-I{ROOT}/shaders", f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/cuda/include",
            "--diag-suppress=1866,1097,2803",  # unknown attributes ([[buffer(n)]], ...)
            "-lineinfo", f"-DLILY_CUDA_FILE={index}"] + (["-Xptxas=-v"] if usage else [])
    return compile_source(lib, arch, src, SHADERS[index], opts, quiet=usage)


def compile_source(lib, arch, src, name, opts, quiet=False):
    """(cubin bytes, seconds, compiler log); the log goes to stderr unless quiet."""
    prog = ctypes.c_void_p()
    chk = lambda r, what: r == 0 or (_ for _ in ()).throw(SystemExit(f"{what} failed: {r}"))
    chk(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"lily_shaders.cu", 0, None, None),
        "nvrtcCreateProgram")
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    t0 = time.time()
    res = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if res != 0:
        sys.stderr.write(text)
        raise SystemExit(f"nvrtc_build: {name}: compile failed ({res}) with {opts}")
    if text.strip() and not quiet:
        sys.stderr.write(text[-4000:])
    chk(lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "nvrtcGetCUBINSize")
    buf = ctypes.create_string_buffer(n.value)
    chk(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
    return buf.raw, time.time() - t0, text


def ptxas_usage(log):
    """{entry symbol: dict(registers, stack, spill_stores, spill_loads)} from a -Xptxas=-v log."""
    out, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = out.setdefault(m.group(1), dict(registers=0, stack=0, spill_stores=0, spill_loads=0))
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
    return out


def elf_sections(blob):
    """{name: (offset, size)} and the symbol table [(name, section index, value, size)]."""
    assert blob[:4] == b"\x7fELF" and blob[4] == 2, "not a 64-bit ELF"
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    secs = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, _info, _al, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", blob, shoff + i * shentsize)
        secs.append((name, typ, off, size, link, entsize))
    stroff = secs[shstrndx][2]
    cstr = lambda base, o: blob[base + o: blob.index(b"\0", base + o)].decode()
    named = [(cstr(stroff, s[0]),) + s[1:] for s in secs]
    syms = []
    for nm, typ, off, size, link, entsize in named:
        if typ == 2:  # SHT_SYMTAB
            strtab = named[link][2]
            for j in range(size // entsize):
                st_name, _info, _other, shndx, value, sz = struct.unpack_from("<IBBHQQ", blob, off + j * entsize)
                syms.append((cstr(strtab, st_name), shndx, value, sz))
    return named, syms


def entries(blob):
    """[(entry symbol, host name, static shared bytes)] from the cubin."""
    named, syms = elf_sections(blob)
    shared = {nm[len(".nv.shared."):]: s[3] for s in named for nm in [s[0]] if nm.startswith(".nv.shared.")}
    out = []
    for name, shndx, value, size in syms:
        m = re.fullmatch(r"(lily_kernel_\d+_\d+)_name", name)
        if not m:
            continue
        sec = named[shndx]
        raw = blob[sec[2] + value: sec[2] + value + size]
        out.append((m.group(1), raw.split(b"\0")[0].decode(), shared.get(m.group(1), 0)))
    return sorted(out, key=lambda e: e[1])


def kernel_ids():
    text = open(os.path.join(ROOT, "csrc", "gpu", "kernel_ids.h")).read()
    return re.findall(r"^\s*X\((\w+),", text, re.M)


def cubin_name(index):
    if index == TOOLS:
        return "tools.cubin"
    return f"{index:02d}_{os.path.basename(SHADERS[index]).split('.')[0]}.cubin"


def one(job):
    arch, index, out, usage = job
    lib, _ = find_nvrtc()
    cubin, secs, log = compile_cubin(lib, arch, index, usage)
    with open(os.path.join(out, cubin_name(index)), "wb") as f:
        f.write(cubin)
    return index, secs, len(cubin), ptxas_usage(log) if usage else {}


def print_usage(es, usage):
    """One line per kernel (host name): registers, stack frame, spills; the spilling ones first."""
    rows = sorted(((usage.get(e, {}), h) for e, h, _ in es),
                  key=lambda r: (-(r[0].get("spill_stores", 0) + r[0].get("spill_loads", 0)), r[1]))
    spilling = sum(1 for u, _ in rows if u.get("spill_stores") or u.get("spill_loads"))
    print(f"ptxas: {spilling} of {len(rows)} kernels spill registers (bytes per thread)")
    print(f"{'kernel':44} {'regs':>5} {'stack':>6} {'spill st':>9} {'spill ld':>9}")
    for u, h in rows:
        print(f"{h:44} {u.get('registers', 0):5d} {u.get('stack', 0):6d} {u.get('spill_stores', 0):9d} "
              f"{u.get('spill_loads', 0):9d}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for the cubins")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--check-ids", action="store_true")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--usage", action="store_true",
                    help="print each kernel's registers, stack frame and spills (ptxas -v), spills first")
    a = ap.parse_args()
    lib, path = find_nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    os.makedirs(a.out, exist_ok=True)
    for old in glob.glob(os.path.join(a.out, "*.cubin")):
        os.remove(old)
    t0 = time.time()
    jobs = [(a.arch, i, a.out, a.usage) for i in list(range(len(SHADERS))) + [TOOLS]]
    if a.j > 1:
        import multiprocessing
        with multiprocessing.Pool(min(a.j, len(jobs))) as pool:
            done = pool.map(one, jobs, chunksize=1)
    else:
        done = [one(j) for j in jobs]
    es = []
    usage = {}
    for index, _secs, _n, use in done:
        usage.update(use)
        if index == TOOLS:
            continue
        es += entries(open(os.path.join(a.out, cubin_name(index)), "rb").read())
    print(f"nvrtc {major.value}.{minor.value} ({path}): {len(es)} kernels in {len(done)} cubins for "
          f"{a.arch} in {time.time() - t0:.1f} s ({sum(d[2] for d in done)} bytes)")
    bad = [f"{h}: {b} bytes of static threadgroup memory > {APPLE_STATIC_TG_LIMIT}" for _, h, b in es
           if b > APPLE_STATIC_TG_LIMIT]
    if a.check_ids:
        have = [h for _, h, _ in es]
        ids = kernel_ids()
        bad += [f"{i}: in kernel_ids.h, not compiled" for i in ids if i not in have]
        bad += [f"{h}: compiled {have.count(h)} times" for h in set(have) if have.count(h) > 1]
        if not bad:
            print(f"kernel_ids.h: {len(ids)} ids, all compiled")
    if bad:
        raise SystemExit("nvrtc_build: " + "\n  ".join(bad))
    with open(os.path.join(a.out, "manifest.txt"), "w") as f:
        for entry in TOOL_ENTRIES:  # host name "__<entry>": no kernel id has a leading underscore
            f.write(f"{cubin_name(TOOLS)} {entry} __{entry}\n")
        for index, *_ in done:
            if index == TOOLS:
                continue
            for entry, host, _b in entries(open(os.path.join(a.out, cubin_name(index)), "rb").read()):
                f.write(f"{cubin_name(index)} {entry} {host}\n")
    if a.usage:
        print_usage(es, usage)
    big = max(es, key=lambda e: e[2])
    print(f"largest static threadgroup memory: {big[2]} bytes ({big[1]}; limit {APPLE_STATIC_TG_LIMIT})")


if __name__ == "__main__":
    main()
