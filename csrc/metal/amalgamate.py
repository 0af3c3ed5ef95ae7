"""Write one self-contained Metal source from shader files (build step, macOS only).

Every `#include "common/..."` is inlined once (the headers use #pragma once), so the Metal device
can compile the result at run time with newLibraryWithSource, which has no include path. Used when
no metallib is installed or it does not load: lily_shaders.metal (shaders/*.metal, MSL 3.1) and
lily_shaders_m5.metal (shaders/m5/*.metal, MSL 4.0; CMakeLists.txt). An include that is not under
--shader-dir is kept as it is when it sits inside an #if / #ifdef block (a branch the Metal
compiler does not take, e.g. common/tensor_ops.h's emulator header under LILY_STRICT); anywhere
else it is an error. System includes (<...>) are kept.

    python amalgamate.py --shader-dir shaders --out lily_shaders.metal shaders/a.metal ...
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

# `#include "x"`, optionally followed by a // comment (which must not hide the include).
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"\s*(//.*)?$')
# Conditional-block depth: #if / #ifdef / #ifndef open one, #endif closes it.
IF_OPEN = re.compile(r'^\s*#\s*if(n?def)?\b')
IF_CLOSE = re.compile(r'^\s*#\s*endif\b')


def inline(path: Path, shader_dir: Path, seen: set[Path]) -> list[str]:
    out = []
    depth = 0
    for line in path.read_text().splitlines():
        if IF_OPEN.match(line):
            depth += 1
        elif IF_CLOSE.match(line):
            depth -= 1
        m = INCLUDE.match(line)
        if m:
            inc = (shader_dir / m.group(1)).resolve()
            if not inc.is_file():
                if depth > 0:  # not a shader header: only for a branch Metal does not compile
                    out.append(line)
                    continue
                raise SystemExit(f"amalgamate.py: {path}: included file {m.group(1)} not found in {shader_dir}")
            if inc not in seen:
                seen.add(inc)
                out.append(f"// ---- {m.group(1)}")
                out.extend(inline(inc, shader_dir, seen))
        elif re.match(r'^\s*#\s*include\s*"', line):
            raise SystemExit(f"amalgamate.py: {path}: cannot parse include line: {line!r}")
        elif line.strip() != "#pragma once":
            out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shader-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("sources", type=Path, nargs="+")
    a = ap.parse_args()
    seen: set[Path] = set()
    lines = ["// Generated from shaders/ by csrc/metal/amalgamate.py. Do not edit."]
    for src in a.sources:
        lines.append(f"// ==== {src.name}")
        lines.extend(inline(src, a.shader_dir, seen))
    a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
