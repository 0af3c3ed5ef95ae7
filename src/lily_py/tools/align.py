"""``lily-py align SRC DST``: rewrite a checkpoint so the engine serves every weight from its pages.

The engine binds a weight at its offset in the mapped checkpoint file when the offset is a
multiple of 16 (Metal's buffer-offset rule and the kernels' 16-byte loads, csrc/core/engine.h:
kMappedAlignment) and, for the weights it fuses at load (DeltaNet ``in_proj`` parts, attention
q/k/v, router + shared-expert gate), when the parts lie back to back in one file. Files written by
MLX start their data right after the JSON header (any offset) and order tensors by name, so few
or none qualify. This rewrite keeps every tensor, its bytes and its shard, and only changes the
layout inside each shard: the header is padded with spaces (the safetensors format allows it) so
the data starts at a multiple of 16, the engine's weights come first in the engine's order (fused
parts back to back), and tensors whose size would shift the rest off 16 bytes come last.
"""
from __future__ import annotations

import json
import os
import shutil
import struct

from ..checkpoint import SafetensorsFile, find_weight_files, load_weights

ALIGN = 16
_CHUNK = 64 << 20


def engine_groups(folder: str) -> list[list[tuple[str, int]]]:
    """The engine's weights as groups of (file, offset) of their parts, in the engine's order."""
    from ..backends.engine import _file_offset, _tensors
    cfg, w = load_weights(folder)
    out = []
    for _name, cls, _lins, parts in _tensors(cfg, w):
        if cls is None:
            continue
        locs = [_file_offset(p) for p in parts]
        if all(loc is not None for loc in locs):
            out.append(locs)
    return out


def align_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> dict:
    """Write ``src`` to ``dst`` (a new folder) laid out for zero copy. Returns counts per file."""
    src, dst = os.fspath(src), os.fspath(dst)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("align: the destination must differ from the source")
    os.makedirs(dst, exist_ok=True)
    groups = engine_groups(src)
    files = find_weight_files(src)
    report = {}
    for path in files:
        sf = SafetensorsFile(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        by_offset = {ref.begin: name for name, ref in sf.tensors.items() if ref.end > ref.begin}
        order: list[list[str]] = []
        placed: set[str] = set()
        for g in groups:
            if any(fn != path for fn, _ in g):
                continue
            names = [by_offset.get(off) for _, off in g]
            if None in names or placed & set(names) or len(set(names)) != len(names):
                continue
            order.append(names)
            placed.update(names)
        order += [[name] for name in sf.tensors if name not in placed]
        size = lambda names: sum(sf.tensors[x].end - sf.tensors[x].begin for x in names)  # noqa: E731
        # groups of whole multiples of 16 first (each starts aligned), the others after
        order = [g for g in order if size(g) % ALIGN == 0] + [g for g in order if size(g) % ALIGN]
        new_header = {"__metadata__": header["__metadata__"]} if "__metadata__" in header else {}
        at = 0
        for g in order:
            for name in g:
                ref = sf.tensors[name]
                nb = ref.end - ref.begin
                new_header[name] = {"dtype": header[name]["dtype"], "shape": header[name]["shape"],
                                    "data_offsets": [at, at + nb]}
                at += nb
        text = json.dumps(new_header, separators=(",", ":")).encode()
        text += b" " * ((-(8 + len(text))) % ALIGN)
        out = os.path.join(dst, os.path.basename(path))
        with open(path, "rb") as fin, open(out, "wb") as fout:
            fout.write(struct.pack("<Q", len(text)))
            fout.write(text)
            for g in order:
                for name in g:
                    ref = sf.tensors[name]
                    fin.seek(ref.begin)
                    left = ref.end - ref.begin
                    while left:
                        buf = fin.read(min(left, _CHUNK))
                        if not buf:
                            raise OSError(f"{path}: short read in tensor {name!r}")
                        fout.write(buf)
                        left -= len(buf)
        aligned = sum(1 for g in order if (8 + len(text) + _start(new_header, g[0])) % ALIGN == 0)
        report[os.path.basename(path)] = {"tensors": len(sf.tensors), "groups": len(order),
                                          "aligned_groups": aligned}
    written = {os.path.basename(p) for p in files}
    for fn in os.listdir(src):
        s = os.path.join(src, fn)
        if fn not in written and os.path.isfile(s):
            shutil.copy2(s, os.path.join(dst, fn))
    return report


def _start(header: dict, name: str) -> int:
    return header[name]["data_offsets"][0]


def file_offsets_of(folder: str) -> dict[str, tuple[str, int, int]]:
    """{tensor name: (file, absolute begin, absolute end)} of every tensor in ``folder``."""
    out = {}
    for path in find_weight_files(folder):
        for name, ref in SafetensorsFile(path).tensors.items():
            out[name] = (path, ref.begin, ref.end)
    return out

