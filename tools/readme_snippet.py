"""Run a Python example of README.md and print its output with speeds masked (for tools/gendocs.py).

    python tools/readme_snippet.py "On the demo:"

Runs the first ```python block after the line that ends with the given text (with `import lily_py`
in scope) and prints what it printed, each `<number> tok/s` written as `N tok/s`: a speed depends
on the machine, the rest (token counts, reuse) does not.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snippet(marker: str) -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    at = text.index(marker + "\n")
    m = re.compile(r"```python\n(.*?)\n```", re.S).search(text, at)
    if m is None:
        raise SystemExit(f"no ```python block after {marker!r} in README.md")
    return m[1]


def main() -> None:
    code = snippet(sys.argv[1])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("import lily_py\n" + code, "README.md", "exec"), {"__name__": "__readme__"})
    sys.stdout.write(re.sub(r"\d[\d,.]*(?:e[+-]?\d+)? tok/s", "N tok/s", out.getvalue()))


if __name__ == "__main__":
    main()
