"""Weights served from the checkpoint's pages (zero copy) on the emulator: every weight the plan
maps is bound at its offset in the mapped file, nothing of it is copied, and the model computes
the same logits as with every weight copied (``load(..., weights="copy")``)."""
import json
import os
import struct

import numpy as np
import pytest

import lily_py
from lily_py.backends.engine import _tensors
from lily_py.checkpoint import SafetensorsFile, load_weights
from lily_py.errors import BackendError
from lily_py.testing import make_checkpoint
from lily_py.tools.align import align_checkpoint

ALIGN = 16
PROMPT = [3, 141, 59, 26, 53, 58, 97]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A random-weight MLX checkpoint (as the safetensors library writes it) and its aligned copy."""
    src = make_checkpoint(tmp_path_factory.mktemp("zc_src"), fmt="mlx", seed=11)
    dst = str(tmp_path_factory.mktemp("zc_aligned") / "ckpt")
    align_checkpoint(src, dst)
    return src, dst


def _engine_parts(folder):
    """{engine weight: [(file, begin, end) of each part, from the safetensors headers]} for the
    quantized weights, and the set of float32 vectors (converted at load)."""
    cfg, w = load_weights(folder)
    where = {}
    for path in w.files:
        sf = SafetensorsFile(path)
        for ref in sf.tensors.values():
            where[ref.begin] = (path, ref)
    parts, vectors = {}, set()
    for name, cls, _lins, arrays in _tensors(cfg, w):
        if cls is None:
            vectors.add(name)
            continue
        locs = []
        for a in arrays:
            # the array's first byte, found in the header by its content and size (not by the
            # code under test): the tensor whose bytes equal the array's bytes
            raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes()
            hit = [(p, r) for p, r in where.values() if r.end - r.begin == len(raw)
                   and _file_bytes(p, r.begin, r.end) == raw]
            assert len(hit) == 1, f"{name}: {len(hit)} tensors with this part's bytes"
            locs.append((hit[0][0], hit[0][1].begin, hit[0][1].end))
        parts[name] = locs
    return parts, vectors


def _file_bytes(path, begin, end):
    with open(path, "rb") as f:
        f.seek(begin)
        return f.read(end - begin)


def test_aligned_checkpoint_keeps_every_tensor(ckpts):
    src, dst = ckpts
    a, b = load_weights(src)[1], load_weights(dst)[1]
    fa, fb = SafetensorsFile(a.files[0]), SafetensorsFile(b.files[0])
    assert set(fa.tensors) == set(fb.tensors)
    for name, ra in fa.tensors.items():
        rb = fb.tensors[name]
        assert (ra.dtype, ra.shape) == (rb.dtype, rb.shape)
        assert np.array_equal(fa.array(ra), fb.array(rb)), name
    with open(b.files[0], "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        json.loads(f.read(n))                 # padded header still parses
    assert (8 + n) % ALIGN == 0


def test_zero_copy_binds_every_weight_at_its_file_offset(ckpts):
    _, dst = ckpts
    m = lily_py.load(dst, backend="emu", context_length=64, prefill_chunk=16)
    eng = m._backend.engine
    parts, vectors = _engine_parts(dst)
    placed = {d["name"]: d for d in eng.weight_sources()}
    expect_mapped = {}
    for name, locs in parts.items():
        same_file = len({p for p, _, _ in locs}) == 1
        back_to_back = all(locs[i + 1][1] == locs[i][2] for i in range(len(locs) - 1))
        if same_file and back_to_back and locs[0][1] % ALIGN == 0:
            expect_mapped[name] = locs
    assert len(expect_mapped) >= 0.9 * len(parts), "the aligned layout should map nearly every weight"
    for name, d in placed.items():
        if name in expect_mapped:
            path, begin, _ = expect_mapped[name][0]
            assert d["why_copied"] is None, (name, d["why_copied"])
            assert d["offset"] == begin, name
            assert d["file"] is not None and d["bytes"] == expect_mapped[name][-1][2] - begin
        else:
            assert d["file"] is None and d["why_copied"], name
    st = m.stats()
    copied = sum(d["bytes"] for n, d in placed.items() if n not in expect_mapped)
    mapped = sum(d["bytes"] for n, d in placed.items() if n in expect_mapped)
    # no byte of a mapped weight was copied: the copies are exactly the float32 vectors and the
    # few quantized weights the layout could not align
    assert st["weights_copied_bytes"] == copied
    assert st["weights_mapped_bytes"] == mapped
    assert st["weights_copied_bytes"] + st["weights_mapped_bytes"] == st["weight_bytes"]
    assert all(n in vectors or n in parts for n in placed)
    unaligned_quant = [n for n in parts if n not in expect_mapped]
    assert sum(placed[n]["bytes"] for n in unaligned_quant) + sum(placed[n]["bytes"] for n in vectors) == copied


def test_zero_copy_computes_what_the_copies_compute(ckpts):
    _, dst = ckpts
    mapped = lily_py.load(dst, backend="emu", context_length=64, prefill_chunk=16)
    copied = lily_py.load(dst, backend="emu", context_length=64, prefill_chunk=16, weights="copy")
    st = copied.stats()
    assert st["weights_mapped_bytes"] == 0 and st["weights_copied_bytes"] == st["weight_bytes"]
    assert mapped.stats()["weights_mapped_bytes"] > 0.9 * st["weight_bytes"]
    a = mapped.prefill(PROMPT, all_logits=True)
    b = copied.prefill(PROMPT, all_logits=True)
    assert np.array_equal(a, b)                      # same kernels over the same bytes
    assert np.array_equal(mapped.decode(7), copied.decode(7))


def test_mlx_layout_copies_what_it_cannot_map(ckpts):
    """A file whose data offsets are not multiples of 16 (any MLX or safetensors-written file
    with an unpadded header) gets those weights copied, each with the reason."""
    src, _ = ckpts
    m = lily_py.load(src, backend="emu", context_length=64, prefill_chunk=16)
    parts, _ = _engine_parts(src)
    placed = {d["name"]: d for d in m._backend.engine.weight_sources()}
    for name, locs in parts.items():
        d = placed[name]
        if d["file"] is not None:
            assert locs[0][1] % ALIGN == 0 and d["offset"] == locs[0][1]
        elif len(locs) == 1 and locs[0][1] % ALIGN:
            assert f"offset {locs[0][1]} " in d["why_copied"] and "multiple of 16" in d["why_copied"]
    st = m.stats()
    assert st["weights_copied_bytes"] + st["weights_mapped_bytes"] == st["weight_bytes"]


def test_fused_weights_whose_parts_lie_apart_are_copied(ckpts):
    src, _ = ckpts
    m = lily_py.load(src, backend="emu", context_length=64, prefill_chunk=16)
    parts, _ = _engine_parts(src)
    reasons = m._backend.copy_reasons
    for name, locs in parts.items():
        apart = len(locs) > 1 and any(locs[i + 1][1] != locs[i][2] for i in range(len(locs) - 1))
        if apart:
            assert "do not lie back to back" in reasons[name]
            assert next(d for d in m._backend.engine.weight_sources() if d["name"] == name)["file"] is None


def test_weights_option(ckpts):
    src, dst = ckpts
    with pytest.raises(ValueError, match="weights must be"):
        lily_py.load(dst, backend="emu", context_length=16, weights="mmap")
    m = lily_py.load(dst, backend="emu", context_length=16, weights="map")
    assert m.stats()["weights_mapped_bytes"] > 0
    # "map" insists: the bundled demo (written by MLX: no data offset is a multiple of 16) maps nothing
    with pytest.raises(BackendError, match=r"weights='map'.*not a multiple of 16"):
        lily_py.load(None, backend="emu", context_length=16, weights="map")


def test_upload_to_a_mapped_weight_is_refused(ckpts):
    _, dst = ckpts
    m = lily_py.load(dst, backend="emu", context_length=16)
    eng = m._backend.engine
    d = next(d for d in eng.weight_sources() if d["file"] is not None)
    with pytest.raises(ValueError, match=r"is bound to .* \(mapped\): nothing to upload"):
        eng.upload(d["name"], [np.zeros(d["bytes"], np.uint8)])


def test_a_mapping_past_the_file_end_is_refused(ckpts):
    _, dst = ckpts
    from lily_py import _core
    from lily_py.backends.engine import checkpoint_quant, engine_spec
    cfg, w = load_weights(dst)
    spec = engine_spec(cfg, checkpoint_quant(w), context_length=16, prefill_chunk=16)
    f = w.files[0]
    with pytest.raises(ValueError, match=r"lie past the end of"):
        _core.Engine(spec, "emu", [f], {"embed.weight": (0, os.path.getsize(f) - 16)})


def test_the_engine_reads_the_file_pages(ckpts, tmp_path):
    """The mapped engine computes from the file's pages themselves: bytes changed in the file after
    the load change its logits (the mapping is shared with the page cache), not a copy's."""
    import shutil
    _, dst = ckpts
    folder = shutil.copytree(dst, tmp_path / "c")
    mapped = lily_py.load(str(folder), backend="emu", context_length=16, prefill_chunk=8)
    copied = lily_py.load(str(folder), backend="emu", context_length=16, prefill_chunk=8, weights="copy")
    before = mapped.prefill(PROMPT)
    assert np.array_equal(before, copied.prefill(PROMPT))
    d = next(d for d in mapped._backend.engine.weight_sources() if d["name"] == "lm_head.scales")
    assert d["file"] is not None
    path = load_weights(str(folder))[1].files[0]
    with open(path, "r+b") as f:                      # halve every lm_head scale (bf16: exponent - 1)
        f.seek(d["offset"])
        s = np.frombuffer(f.read(d["bytes"]), np.uint16).copy()
        f.seek(d["offset"])
        f.write((s - np.uint16(0x80)).tobytes())
    mapped.reset(), copied.reset()
    after_mapped, after_copied = mapped.prefill(PROMPT), copied.prefill(PROMPT)
    assert np.array_equal(after_copied, before)      # the copy kept the old bytes
    assert not np.array_equal(after_mapped, before)  # the mapping sees the file's new bytes
