"""Regenerate (or check) the command output quoted in docs/*.md and README.md.

    python tools/gendocs.py            # rewrite every generated block in place
    python tools/gendocs.py --check    # exit 1 with a diff per stale block, write nothing
    python tools/gendocs.py --check --quick   # the same without the blocks marked slow
    python tools/gendocs.py --check --slow-only   # only the blocks marked slow
    python tools/gendocs.py --list     # the blocks and their commands
    python tools/gendocs.py --check --slow-only --page docs/int8.md   # one page (repeatable)

A generated block is

    <!-- gen: python benchmarks/engine.py --counts -->
    ```
    ...the command's stdout, exactly...
    ```
    <!-- end gen -->

`gen-raw:` instead of `gen:` puts the stdout in the page as Markdown (a table, say) instead of
inside a fence; `gen slow:` / `gen-raw slow:` marks a command of a minute or more, which
`--quick` skips (the quick test tier checks the rest, the full tier everything). Commands run
from the repository root through bash with pipefail, with this Python's directory first on PATH
(so `python` and `lily-py` are the installed package's), with PYTHONHASHSEED=0 and one thread
per BLAS pool. They must be deterministic: counts, sizes, derived
estimates; never timings, dates or anything measured on the machine that runs them. A command
quoted by several blocks runs once.

Error figures (max_rel, NMSE) depend on the order of float32 sums, and both NumPy's loops and its
OpenBLAS pick kernels by the CPU: the same command printed other digits on an AVX2 machine than
on an AVX-512 one. So on x86-64 every command runs with the kernels of one CPU level, x86-64-v3
(AVX2 and FMA, which every x86 CI machine has): OPENBLAS_CORETYPE=Haswell, and NumPy's AVX-512
dispatch turned off (NUMERICS_ENV; `python tools/numerics_env.py` prints what a process gets).
The NumPy version matters too (it ships the OpenBLAS): CI installs the one in
.ci/constraints.txt.
"""
from __future__ import annotations

import argparse
import difflib
import glob
import os
import platform
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"^(?P<open><!-- gen(?P<raw>-raw)?(?P<slow> slow)?: (?P<cmd>.+?) -->\n)(?P<body>.*?)(?P<close><!-- end gen -->)$",
                   re.S | re.M)
OPEN = re.compile(r"^<!-- gen(-raw)?( slow)?: ", re.M)
FENCE = "```"


def pages() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]


# One CPU level for every x86-64 machine (see the docstring; `python tools/numerics_env.py` prints
# what a process gets). The pages are generated on x86-64; elsewhere the error figures cannot
# match them digit for digit, and nothing is pinned.
X86 = platform.machine().lower() in ("x86_64", "amd64")
NUMERICS_ENV = {"OPENBLAS_CORETYPE": "Haswell", "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR"} if X86 else {}


def run(cmd: str, cache: dict[str, str]) -> str:
    if cmd not in cache:
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   **NUMERICS_ENV,
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        # pipefail: a failing command (a test that fails, say) is an error even when piped into grep
        p = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=ROOT, env=env, capture_output=True,
                           text=True)
        if p.returncode != 0:
            raise SystemExit(f"gendocs: `{cmd}` exited {p.returncode}:\n{p.stderr[-4000:]}")
        out = p.stdout
        if out and not out.endswith("\n"):
            out += "\n"
        cache[cmd] = out
    return cache[cmd]


def render(text: str, cache: dict[str, str], quick: bool = False,
           slow_only: bool = False) -> tuple[str, list[tuple[str, str, str]]]:
    """The page with every block regenerated, and (command, old body, new body) per block.
    ``quick``: blocks marked `gen slow:` are left as they are (not run, not compared);
    ``slow_only``: only those are run and compared."""
    blocks = []

    def one(m: re.Match) -> str:
        if (quick and m["slow"]) or (slow_only and not m["slow"]):
            return m[0]
        out = run(m["cmd"], cache)
        body = out if m["raw"] else f"{FENCE}\n{out}{FENCE}\n"
        blocks.append((m["cmd"], m["body"], body))
        return m["open"] + body + m["close"]

    return BLOCK.sub(one, text), blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a block differs")
    ap.add_argument("--list", action="store_true", help="print page: command for every block")
    ap.add_argument("--quick", action="store_true",
                    help="skip the blocks marked `gen slow:` (commands of a minute or more)")
    ap.add_argument("--slow-only", action="store_true",
                    help="only the blocks marked `gen slow:` (the full test tier: --quick's are the quick tier's)")
    ap.add_argument("--page", action="append", default=[],
                    help="only this page (a path, e.g. docs/int8.md from the repository root); repeatable")
    a = ap.parse_args(argv)
    known = {os.path.relpath(p, ROOT) for p in pages()}
    asked = {p: os.path.relpath(os.path.abspath(p), ROOT) for p in a.page}  # paths from the current directory
    only = set(asked.values())
    unknown = [p for p, rel in asked.items() if rel not in known]
    if unknown:
        print(f"gendocs: no such page: {', '.join(unknown)} (pages: docs/*.md, README.md)", file=sys.stderr)
        return 2
    cache: dict[str, str] = {}
    stale = 0
    for path in pages():
        rel = os.path.relpath(path, ROOT)
        if only and rel not in only:
            continue
        text = open(path, encoding="utf-8").read()
        if a.list:
            for m in BLOCK.finditer(text):
                print(f"{rel}:{' (slow)' if m['slow'] else ''} {m['cmd']}")
            continue
        if len(OPEN.findall(text)) != len(BLOCK.findall(text)):
            print(f"{rel}: a `<!-- gen` marker without its `<!-- end gen -->`", file=sys.stderr)
            return 2
        new, blocks = render(text, cache, quick=a.quick, slow_only=a.slow_only)
        for cmd, old, body in blocks:
            if old != body:
                stale += 1
                print(f"{rel}: stale block `{cmd}`")
                if a.check:
                    sys.stdout.writelines(difflib.unified_diff(
                        old.splitlines(True), body.splitlines(True), f"{rel} (as written)",
                        f"{rel} (as `{cmd}` prints it)"))
        if new != text and not a.check:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    if a.check and stale:
        print(f"{stale} stale block(s); run `python tools/gendocs.py` and commit the result")
        return 1
    if not a.list:
        print(f"{len(cache)} command(s), {stale} block(s) {'stale' if a.check else 'rewritten'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
