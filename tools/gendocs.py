#!/usr/bin/env python3
"""Generated blocks in the docs: every number a command can print is printed by that command.

A block in docs/*.md or README.md reads

    <!-- gen: python benchmarks/decode_table.py --no-table -->
    ```text
    ...the command's standard output, exactly...
    ```
    <!-- end gen -->

or `<!-- gen-md: ... -->` for a command that prints Markdown (tables), inserted as it is.
`python tools/gendocs.py` runs each block's command (bash, from the project root, with this
interpreter's `python` and scripts first on PATH) and rewrites the block; `python tools/gendocs.py --check` rewrites nothing and exits 1
with a diff naming the page and the command of every block whose text differs (CI runs it through
tests/api/test_docs.py). Commands must be deterministic: counters and estimates, never timings.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- gen(?P<md>-md)?: (?P<cmd>.+?) -->\n)(?P<body>.*?)(?P<end><!-- end gen -->)", re.S)


def pages(root: str = ROOT) -> list[str]:
    docs = os.path.join(root, "docs")
    out = [os.path.join(root, "README.md")]
    out += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return out


def run(cmd: str, root: str = ROOT) -> str:
    """The command's stdout, run by bash from the project root with this interpreter's `python`
    (and its scripts, e.g. `lily-py`) first on PATH."""
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PYTHONHASHSEED="0", COLUMNS="100",
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    if not os.path.exists(os.path.join(bindir, "python")):
        cmd = re.sub(r"^python\b", shlex.quote(sys.executable), cmd)
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"gendocs: `{cmd}` exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def body_for(output: str, markdown: bool) -> str:
    """`gen:` blocks are fenced as text; `gen-md:` blocks are the command's Markdown as it is."""
    output = output.strip("\n") + "\n"
    return output if markdown else "```text\n" + output + "```\n"


def process(path: str, cache: dict[str, str], root: str = ROOT) -> tuple[str, str, list[str]]:
    """(old text, new text, diffs) of one page."""
    text = open(path, encoding="utf-8").read()
    diffs: list[str] = []
    rel = os.path.relpath(path, root)

    def replace(m: re.Match) -> str:
        cmd = m.group("cmd").strip()
        if cmd not in cache:
            cache[cmd] = run(cmd, root)
        new = body_for(cache[cmd], bool(m.group("md")))
        if new != m.group("body"):
            diffs.append("".join(difflib.unified_diff(
                m.group("body").splitlines(True), new.splitlines(True),
                f"{rel} (as written)", f"`{cmd}` (as printed now)", n=1)))
        return m.group(1) + new + m.group("end")

    return text, BLOCK.sub(replace, text), diffs


def main(argv: list[str] | None = None, root: str = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a block is stale")
    ap.add_argument("--list", action="store_true", help="print each page's block commands")
    args = ap.parse_args(argv)
    cache: dict[str, str] = {}
    stale = 0
    for path in pages(root):
        text = open(path, encoding="utf-8").read()
        if args.list:
            for m in BLOCK.finditer(text):
                print(f"{os.path.relpath(path, root)}: {m.group('cmd').strip()}")
            continue
        if not BLOCK.search(text):
            continue
        old, new, diffs = process(path, cache, root)
        if diffs:
            stale += len(diffs)
            if args.check:
                for d in diffs:
                    sys.stdout.write(d)
            else:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
                print(f"gendocs: rewrote {len(diffs)} block(s) in {os.path.relpath(path, root)}")
    if args.check and stale:
        print(f"gendocs: {stale} generated block(s) differ from what their command prints now; "
              f"run `python tools/gendocs.py` and commit the result", file=sys.stderr)
        return 1
    if args.check and not args.list:
        print(f"gendocs: {len(cache)} command(s), every generated block up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
