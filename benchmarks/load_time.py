"""Load time and weight bytes, every weight copied vs served from the checkpoint's pages (zero copy),
of a random-weight checkpoint at the real config's shapes with few layers (a timing: not a test).

    python benchmarks/load_time.py [--layers 4] [--device emu] [--dir DIR]

Writes the checkpoint once (safetensors library layout) and its `lily-py align` copy under --dir
(default: a temporary folder), then loads each with ``weights="copy"`` and ``"auto"``
(lily_py.tools.bench.measure_load) and prints the LOAD tables.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile

from lily_py.testing import REAL_TEXT_CONFIG, make_checkpoint
from lily_py.tools.align import align_checkpoint
from lily_py.tools.bench import format_load, measure_load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="layers of the real config kept (3 DeltaNet : 1 attention)")
    ap.add_argument("--device", default="emu", choices=["emu", "metal", "cuda"])
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (kept when given)")
    a = ap.parse_args()
    logging.getLogger("lily_py").setLevel(logging.ERROR)
    tmp = None if a.dir else tempfile.TemporaryDirectory(prefix="lily_load_")
    root = a.dir or tmp.name
    text = dict(REAL_TEXT_CONFIG, num_hidden_layers=a.layers)
    text.pop("layer_types", None)
    src, dst = os.path.join(root, "src"), os.path.join(root, "aligned")
    if not os.path.exists(src):
        make_checkpoint(src, text, fmt="mlx", seed=0)
    if not os.path.exists(dst):
        align_checkpoint(src, dst)
    for name, path in (("as written by the safetensors library", src), ("after `lily-py align`", dst)):
        print(f"{name}: {path}")
        print(format_load(measure_load(path, a.device), a.device))
        print()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
