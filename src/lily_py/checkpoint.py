"""Checkpoint loading: safetensors headers, memory maps, MLX quantization, tensor accounting.

``load_weights(folder)`` returns the validated ``ModelConfig`` and a ``ModelWeights`` tree whose
matrices are views into memory-mapped files (nothing is copied; quantized weights stay packed).
Every tensor in the files is accounted for: it is used by the model, or skipped by one of the
explicit rules in ``SKIP_RULES`` (vision tower, multi-token-prediction head). Anything else is an
error that names the tensor, as is a missing, truncated or mis-shaped one.

Formats (see MODEL_FACTS.md sections 3 and 5):

* MLX (mlx-lm conversions): names ``language_model.model.*`` / ``language_model.lm_head.*``,
  stacked experts ``mlp.switch_mlp.{gate,up,down}_proj``, quantized modules as
  ``.weight`` (uint32) + ``.scales`` + ``.biases``, zero-centred norms stored **folded** (``1 + w``),
  ``conv1d.weight`` as ``[C, K, 1]``.
* Hugging Face: names ``model.*`` or ``model.language_model.*``, experts fused
  (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) or per expert
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``), norms **zero-centred** (stores ``w``; the
  model multiplies by ``1 + w``), ``conv1d.weight`` as ``[C, 1, K]``.

The norm convention is decided the way mlx-lm decides it: by the conv1d layout.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
import ml_dtypes
import numpy as np

from .config import ModelConfig, QuantSpec, canonical_module_name
from .errors import CheckpointError, ConfigError
from .weights import DenseLinear, Linear, QuantLinear, StackedLinear

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

# Tensors that exist in real checkpoints and that the text model does not use.
SKIP_RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("vision tower", re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")),
    ("multi-token-prediction head (MTP)", re.compile(r"(^|\.)mtp\.")),
    ("rotary inv_freq buffer (recomputed from the config)", re.compile(r"rotary_emb\.inv_freq$")),
)

_MAX_HEADER = 100 * 1024 * 1024


def _skip_rule(name: str) -> str | None:
    """The SKIP_RULES entry that covers tensor ``name``, if any."""
    return next((r for r, pat in SKIP_RULES if pat.search(name)), None)


@dataclass
class TensorRef:
    name: str            # name as stored in the file
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int           # absolute byte offsets in the file
    end: int


class SafetensorsFile:
    """One .safetensors file: header parsed, data memory-mapped read-only (zero copy)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
        if size < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes; a safetensors file starts "
                                  "with an 8-byte header length)")
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: header length {n} exceeds the file size {size} "
                                      "(truncated or not a safetensors file)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        base = 8 + n
        self.tensors: dict[str, TensorRef] = {}
        for name, info in header.items():
            if isinstance(info, dict) and info.get("dtype") not in _DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, "
                                      f"which lily_py does not read (supported: "
                                      f"{', '.join(_DTYPES)})")
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                b, e = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as ex:
                raise CheckpointError(f"{path}: tensor {name!r}: bad header entry {info!r} "
                                      f"({type(ex).__name__}: {ex})") from None
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if e - b != nbytes:
                raise CheckpointError(f"{path}: tensor {name!r}: {dtype} {list(shape)} needs "
                                      f"{nbytes} bytes, header gives {e - b}")
            if base + e > size:
                raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {base + e}, "
                                      f"file has {size} bytes")
            self.tensors[name] = TensorRef(name, path, dtype, shape, base + b, base + e)
        self._map: np.memmap | None = None
        self._size = size

    def array(self, ref: TensorRef) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(self._size,))
        if ref.end == ref.begin:
            return np.zeros(ref.shape, dtype=ref.dtype)
        return self._map[ref.begin:ref.end].view(ref.dtype).reshape(ref.shape)


def find_weight_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files: from model.safetensors.index.json, else *.safetensors.

    A shard listed in the index may be absent if every tensor the index puts in it is skipped
    by a rule (a vision-only shard that a hub download left out on purpose)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        needed = {fn for name, fn in weight_map.items() if not _skip_rule(name)}
        files = sorted(fn for fn in set(weight_map.values())
                       if fn in needed or os.path.exists(os.path.join(folder, fn)))
        missing = [fn for fn in files if not os.path.exists(os.path.join(folder, fn))]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) that are missing from {folder}: "
                                  + ", ".join(missing))
        return [os.path.join(folder, fn) for fn in files]
    files = sorted(fn for fn in os.listdir(folder) if fn.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files")
    return [os.path.join(folder, fn) for fn in files]


@dataclass
class AttentionWeights:
    q_proj: Linear        # [2*Hq*D, H]: per head [query(D) | gate(D)]
    k_proj: Linear        # [Hkv*D, H]
    v_proj: Linear        # [Hkv*D, H]
    o_proj: Linear        # [H, Hq*D]
    q_norm: np.ndarray    # [D] effective multiplier (1 + w_hf)
    k_norm: np.ndarray    # [D]


@dataclass
class DeltaNetWeights:
    in_proj_qkv: Linear   # [2*Dk*Hk + Dv*Hv, H]: rows q | k | v
    in_proj_z: Linear     # [Hv*Dv, H]
    in_proj_b: Linear     # [Hv, H]
    in_proj_a: Linear     # [Hv, H]
    conv1d: np.ndarray    # [conv_dim, K] float32
    dt_bias: np.ndarray   # [Hv] float32
    A_log: np.ndarray     # [Hv] float32
    norm: np.ndarray      # [Dv] float32, plain weight (not zero-centred)
    out_proj: Linear      # [H, Hv*Dv]


@dataclass
class MoEWeights:
    router: Linear              # [E, H]
    gate_proj: Linear           # [E, I, H]
    up_proj: Linear             # [E, I, H]
    down_proj: Linear           # [E, H, I]
    shared_gate_proj: Linear    # [Is, H]
    shared_up_proj: Linear      # [Is, H]
    shared_down_proj: Linear    # [H, Is]
    shared_expert_gate: Linear  # [1, H]


@dataclass
class LayerWeights:
    kind: str                   # "linear_attention" | "full_attention"
    input_norm: np.ndarray      # [H] effective multiplier
    post_norm: np.ndarray       # [H]
    mixer: AttentionWeights | DeltaNetWeights
    moe: MoEWeights


@dataclass
class ModelWeights:
    embed: Linear               # [V, H]
    layers: list[LayerWeights]
    norm: np.ndarray            # [H] effective multiplier
    lm_head: Linear             # [V, H]
    format: str                 # "mlx" | "hf"
    norm_convention: str        # "folded" | "zero-centred" (as stored)
    files: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)   # rule -> tensor count

    def nbytes(self) -> int:
        total = self.embed.nbytes + (0 if self.lm_head is self.embed else self.lm_head.nbytes)
        for layer in self.layers:
            for part in (layer.mixer, layer.moe):
                for v in vars(part).values():
                    if isinstance(v, Linear):
                        total += v.nbytes
        return total


class _Loader:
    def __init__(self, folder: str, cfg: ModelConfig):
        self.folder, self.cfg = folder, cfg
        self.files = find_weight_files(folder)
        self.st: dict[str, SafetensorsFile] = {}
        self.index: dict[str, tuple[SafetensorsFile, TensorRef]] = {}
        self.skipped: dict[str, int] = {}
        self.used: set[str] = set()
        for path in self.files:
            sf = SafetensorsFile(path)
            self.st[path] = sf
            for name, ref in sf.tensors.items():
                rule = _skip_rule(name)
                if rule is not None:
                    self.skipped[rule] = self.skipped.get(rule, 0) + 1
                    continue
                canon = canonical_module_name(name)
                if canon in self.index:
                    raise CheckpointError(f"{path}: tensor {name!r} duplicates "
                                          f"{self.index[canon][1].name!r} in {self.index[canon][1].file}")
                self.index[canon] = (sf, ref)
        self.is_mlx = self._detect_mlx()
        self._check_overrides()

    def _check_overrides(self) -> None:
        """A per-module quantization override in config.json must name a module of the checkpoint
        (one with a ``.weight``, or one a SKIP_RULES entry covers): one that does not exist is a
        typo or a config from another model, and would silently not apply."""
        q = self.cfg.quantization
        if q is None or not q.overrides:
            return
        skipped_modules = set()
        for sf in self.st.values():
            for name in sf.tensors:
                if _skip_rule(name) is not None:
                    skipped_modules.add(canonical_module_name(name).rsplit(".", 1)[0])
        for module, spec in q.overrides.items():
            if module + ".weight" in self.index or module in skipped_modules \
                    or _skip_rule(module + ".weight") is not None:
                continue
            import difflib
            near = difflib.get_close_matches(module, [n[:-len(".weight")] for n in self.index
                                                      if n.endswith(".weight")], n=1)
            hint = f"; the nearest module is {near[0]!r}" if near else ""
            raise ConfigError(
                f"{os.path.join(self.folder, 'config.json')}: field 'quantization': an override "
                f"({spec.bits}-bit group {spec.group_size}) for module {module!r}, which the "
                f"checkpoint does not have (no tensor {module + '.weight'!r} in "
                f"{len(self.files)} file(s)){hint}")

    def _detect_mlx(self) -> bool:
        for name, (_, ref) in self.index.items():
            if name.endswith("linear_attn.conv1d.weight") and len(ref.shape) == 3:
                return ref.shape[-1] == 1          # MLX [C, K, 1] vs HF [C, 1, K]
        if any(sf.metadata.get("format") == "mlx" for sf in self.st.values()):
            return True
        return any(".switch_mlp." in n or n.endswith(".scales") for n in self.index)

    # ---- tensor access ----------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.index

    def raw(self, name: str) -> np.ndarray:
        if name not in self.index:
            raise CheckpointError(f"{self.folder}: missing tensor {name!r} "
                                  f"(needed by the config: {self.cfg.summary()})")
        sf, ref = self.index[name]
        self.used.add(name)
        return sf.array(ref)

    def shape_error(self, name: str, expected, found) -> CheckpointError:
        sf, ref = self.index[name]
        return CheckpointError(f"{ref.file}: tensor {ref.name!r}: expected shape {list(expected)}, "
                               f"found {list(found)}")

    def vector(self, name: str, size: int, *, add_one: bool = False) -> np.ndarray:
        a = self.raw(name)
        if a.shape != (size,):
            raise self.shape_error(name, (size,), a.shape)
        v = np.array(a, dtype=np.float32)
        return v + 1.0 if add_one else v

    def norm(self, name: str, size: int) -> np.ndarray:
        """Zero-centred RMSNorm weight as its effective multiplier."""
        return self.vector(name, size, add_one=not self.is_mlx)

    def linear(self, module: str, shape: tuple[int, ...]) -> Linear:
        """A (possibly quantized, possibly stacked) weight of logical ``shape``."""
        wname = module + ".weight"
        if not self.has(wname):
            raise CheckpointError(f"{self.folder}: missing tensor {wname!r} (expected logical "
                                  f"shape {list(shape)})")
        w = self.raw(wname)
        if not self.has(module + ".scales"):
            if w.dtype == np.uint32:
                raise CheckpointError(f"{self.index[wname][1].file}: tensor {wname!r} is packed "
                                      f"uint32 but {module}.scales is missing")
            if w.shape != shape:
                raise self.shape_error(wname, shape, w.shape)
            if w.dtype.kind != "f" and w.dtype != ml_dtypes.bfloat16:
                raise CheckpointError(f"{self.index[wname][1].file}: tensor {wname!r}: expected a "
                                      f"float dtype, found {w.dtype}")
            return DenseLinear(w)
        scales, biases = self.raw(module + ".scales"), self.raw(module + ".biases") \
            if self.has(module + ".biases") else None
        if biases is None:
            raise CheckpointError(f"{self.folder}: {module}.scales present but {module}.biases "
                                  "missing (only MLX affine quantization is supported)")
        spec = self._quant_spec(module, w, scales, shape)
        lead, in_dim = shape[:-1], shape[-1]
        exp_w = lead + (in_dim * spec.bits // 32,)
        exp_s = lead + (in_dim // spec.group_size,)
        if w.dtype != np.uint32 or w.shape != exp_w:
            raise CheckpointError(
                f"{self.index[wname][1].file}: tensor {wname!r}: for logical shape {list(shape)} at "
                f"{spec.bits} bits expected uint32 {list(exp_w)}, found {w.dtype} {list(w.shape)}")
        for part, a in (("scales", scales), ("biases", biases)):
            if a.shape != exp_s:
                raise self.shape_error(f"{module}.{part}", exp_s, a.shape)
        return QuantLinear(w, scales, biases, spec.bits, spec.group_size)

    def _quant_spec(self, module: str, w: np.ndarray, scales: np.ndarray,
                    shape: tuple[int, ...]) -> QuantSpec:
        in_dim = shape[-1]
        q = self.cfg.quantization
        if q is not None:
            spec = q.spec_for(module)
            if w.shape[-1] * 32 == in_dim * spec.bits and scales.shape[-1] * spec.group_size == in_dim:
                return spec
            which = "override" if module in q.overrides else "default"
            implied = ""
            if w.shape[-1] * 32 % in_dim == 0 and scales.shape[-1] and in_dim % scales.shape[-1] == 0:
                implied = (f" (the shapes imply {w.shape[-1] * 32 // in_dim}-bit group "
                           f"{in_dim // scales.shape[-1]})")
            # A contradiction is an error rather than a silent guess: the config would report a
            # bit width the model does not have.
            raise CheckpointError(
                f"{self.index[module + '.weight'][1].file}: {module}: the config's quantization "
                f"{which} says {spec.bits}-bit group {spec.group_size}, but the packed weight "
                f"{list(w.shape)} and scales {list(scales.shape)} do not fit in-dim {in_dim}"
                f"{implied}; fix 'quantization' in config.json (or add a per-module entry)")
        # No quantization in the config: infer from shapes.
        bits_num = w.shape[-1] * 32
        if bits_num % in_dim or scales.shape[-1] == 0 or in_dim % scales.shape[-1]:
            raise CheckpointError(
                f"{self.index[module + '.weight'][1].file}: {module}: packed weight "
                f"{list(w.shape)} / scales {list(scales.shape)} do not match logical shape "
                f"{list(shape)}")
        bits, group = bits_num // in_dim, in_dim // scales.shape[-1]
        if bits not in (2, 3, 4, 5, 6, 8) or group not in (32, 64, 128):
            raise CheckpointError(
                f"{self.index[module + '.weight'][1].file}: {module}: shapes imply {bits}-bit "
                f"quantization with group size {group}; supported are 2-6 or 8 bits and groups "
                "of 32, 64 or 128")
        return QuantSpec(bits, group)

    # ---- model structure --------------------------------------------------------------------
    def build(self) -> ModelWeights:
        c = self.cfg
        H, V = c.hidden_size, c.vocab_size
        embed = self.linear("embed_tokens", (V, H))
        if self.has("lm_head.weight"):
            lm_head = self.linear("lm_head", (V, H))
        elif c.tie_word_embeddings:
            lm_head = embed
        else:
            raise CheckpointError(f"{self.folder}: missing tensor 'lm_head.weight' "
                                  "(tie_word_embeddings is false)")
        layers = [self._layer(i) for i in range(c.num_hidden_layers)]
        norm = self.norm("norm.weight", H)
        unused = sorted(set(self.index) - self.used)
        if unused:
            names = [self.index[n][1].name for n in unused]
            more = f" and {len(names) - 10} more" if len(names) > 10 else ""
            raise CheckpointError(
                f"{self.folder}: {len(names)} tensor(s) are neither used by the model nor skipped "
                f"by a rule ({', '.join(r for r, _ in SKIP_RULES)}): {', '.join(names[:10])}{more}. "
                "Is the config's num_hidden_layers / num_experts right?")
        return ModelWeights(embed, layers, norm, lm_head, "mlx" if self.is_mlx else "hf",
                            "folded" if self.is_mlx else "zero-centred", self.files, self.skipped)

    def _layer(self, i: int) -> LayerWeights:
        c, p = self.cfg, f"layers.{i}."
        H = c.hidden_size
        if c.is_full_attention(i):
            D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
            mixer = AttentionWeights(
                q_proj=self.linear(p + "self_attn.q_proj", (2 * Hq * D, H)),
                k_proj=self.linear(p + "self_attn.k_proj", (Hkv * D, H)),
                v_proj=self.linear(p + "self_attn.v_proj", (Hkv * D, H)),
                o_proj=self.linear(p + "self_attn.o_proj", (H, Hq * D)),
                q_norm=self.norm(p + "self_attn.q_norm.weight", D),
                k_norm=self.norm(p + "self_attn.k_norm.weight", D),
            )
        else:
            a, Hv, K = p + "linear_attn.", c.linear_num_value_heads, c.linear_conv_kernel_dim
            conv = self.raw(a + "conv1d.weight")
            C = c.linear_conv_dim
            want = (C, K, 1) if self.is_mlx else (C, 1, K)
            if conv.shape != want:
                raise self.shape_error(a + "conv1d.weight", want, conv.shape)
            mixer = DeltaNetWeights(
                in_proj_qkv=self.linear(a + "in_proj_qkv", (C, H)),
                in_proj_z=self.linear(a + "in_proj_z", (c.linear_value_dim, H)),
                in_proj_b=self.linear(a + "in_proj_b", (Hv, H)),
                in_proj_a=self.linear(a + "in_proj_a", (Hv, H)),
                conv1d=np.array(conv.reshape(C, K), dtype=np.float32),
                dt_bias=self.vector(a + "dt_bias", Hv),
                A_log=self.vector(a + "A_log", Hv),
                norm=self.vector(a + "norm.weight", c.linear_value_head_dim),
                out_proj=self.linear(a + "out_proj", (H, c.linear_value_dim)),
            )
        return LayerWeights(
            kind=c.layer_types[i],
            input_norm=self.norm(p + "input_layernorm.weight", H),
            post_norm=self.norm(p + "post_attention_layernorm.weight", H),
            mixer=mixer,
            moe=self._moe(p + "mlp."),
        )

    def _moe(self, m: str) -> MoEWeights:
        c = self.cfg
        H, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, \
            c.shared_expert_intermediate_size
        if self.has(m + "switch_mlp.gate_proj.weight"):                       # MLX stacked
            gate = self.linear(m + "switch_mlp.gate_proj", (E, I, H))
            up = self.linear(m + "switch_mlp.up_proj", (E, I, H))
            down = self.linear(m + "switch_mlp.down_proj", (E, H, I))
        elif self.has(m + "experts.gate_up_proj"):                            # HF fused
            gu = self.raw(m + "experts.gate_up_proj")
            if gu.shape != (E, 2 * I, H):
                raise self.shape_error(m + "experts.gate_up_proj", (E, 2 * I, H), gu.shape)
            dn = self.raw(m + "experts.down_proj")
            if dn.shape != (E, H, I):
                raise self.shape_error(m + "experts.down_proj", (E, H, I), dn.shape)
            gate, up, down = DenseLinear(gu[:, :I]), DenseLinear(gu[:, I:]), DenseLinear(dn)
        else:                                                                 # HF per expert
            gate = StackedLinear([self.linear(f"{m}experts.{e}.gate_proj", (I, H)) for e in range(E)])
            up = StackedLinear([self.linear(f"{m}experts.{e}.up_proj", (I, H)) for e in range(E)])
            down = StackedLinear([self.linear(f"{m}experts.{e}.down_proj", (H, I)) for e in range(E)])
        return MoEWeights(
            router=self.linear(m + "gate", (E, H)),
            gate_proj=gate, up_proj=up, down_proj=down,
            shared_gate_proj=self.linear(m + "shared_expert.gate_proj", (Is, H)),
            shared_up_proj=self.linear(m + "shared_expert.up_proj", (Is, H)),
            shared_down_proj=self.linear(m + "shared_expert.down_proj", (H, Is)),
            shared_expert_gate=self.linear(m + "shared_expert_gate", (1, H)),
        )


def load_weights(folder: str | os.PathLike, cfg: ModelConfig | None = None
                 ) -> tuple[ModelConfig, ModelWeights]:
    """Validate ``folder``'s config and map its weights. Raises ConfigError / CheckpointError."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: not a directory")
    cfg = cfg or ModelConfig.from_file(folder)
    loader = _Loader(folder, cfg)
    return cfg, loader.build()


def text_weight_files(index: dict) -> list[str]:
    """Shards of a sharded checkpoint that hold at least one tensor the text model uses."""
    return sorted({fn for name, fn in index.get("weight_map", {}).items() if not _skip_rule(name)})
