"""Read Llama-family GGUF files (llama.cpp's format) into canonical float32 tensors.

The header (metadata and tensor table) is parsed here with :mod:`struct` over a memory map, because
``gguf.GGUFReader`` builds a numpy view per vocabulary string and needs ~5.5 s just to open the 98 MB
SmolLM2 file; this parser skips string arrays it does not need and opens it in well under 0.1 s.
Tensor data is dequantised with ``gguf.quants.dequantize`` (Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/...),
one tensor per :meth:`GGUFCheckpoint.get` call.

llama.cpp's converter permutes the rows of ``q`` and ``k`` of ``llama`` models (it pairs rotary
dimensions ``(2j, 2j+1)``, HF pairs ``(j, j + d/2)``)::

    W_gguf = W_hf.reshape(n, 2, d/2, h).swapaxes(1, 2).reshape(n*d, h)     # n = heads of that proj

so :func:`unpermute_rows` applies the inverse, ``reshape(n, d/2, 2, h).swapaxes(1, 2)``. ``qwen2``
files are written unpermuted (NeoX rope layout, same as HF).

Partial reads (:meth:`GGUFCheckpoint.get_rows` / :meth:`~GGUFCheckpoint.get_cols`, for one
tensor-parallel rank's slice): ggml stores a tensor row-major, each row a run of self-contained
quantisation blocks (a block holds its own scale/min, so dequantising it needs no other block). Rows
are therefore read and dequantised selectively: only the needed rows' bytes are copied out of a
memory map. Columns are selected per *block*: every row is still visited (the bytes of one column
range are strided through the whole tensor, so the pages read from disk are about the same as for
the whole tensor), but only the blocks covering the needed columns are copied and dequantised, so
time and memory scale with the slice. q/k rows are un-permuted per head, so a row read covers the
whole heads its rows belong to.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig

# GGUF metadata value types (gguf.GGUFValueType): struct format of the fixed-size ones.
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32

# general.architecture -> (HF class name, q/k stored permuted by llama.cpp)
SUPPORTED_GGUF_ARCHS = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

# GGUF tensor suffix inside a block -> canonical suffix
_BLOCK_NAMES = {
    "attn_norm": "attn_norm", "ffn_norm": "mlp_norm",
    "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
    "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
}
_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm.weight",
                 "output.weight": "lm_head"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is in torch order (GGUF lists dims reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    """Parsed header of a GGUF file: ``metadata`` (string arrays not in ``keep`` are replaced by
    their length) and ``tensors`` by GGUF name. Tensor bytes stay on disk until :meth:`raw`."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    @classmethod
    def open(cls, path: str, keep: frozenset[str] = frozenset()) -> GGUFFile:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return cls._parse(path, buf, keep)
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise SyncdropError(f"model file {path}: truncated or corrupt GGUF header ({e})") from e
        finally:
            buf.close()

    @classmethod
    def _parse(cls, path: str, buf: mmap.mmap, keep: frozenset[str]) -> GGUFFile:
        if buf[:4] != b"GGUF":
            raise SyncdropError(f"model file {path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise SyncdropError(f"model file {path}: GGUF version {version} unsupported (expected 2 or 3, "
                                "little-endian)")
        pos = 24

        def string(p: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, p)
            return buf[p + 8 : p + 8 + n].decode("utf-8"), p + 8 + n

        def value(p: int, vtype: int, keep_strings: bool) -> tuple[Any, int]:
            if vtype in _SCALAR_FMT:
                fmt = _SCALAR_FMT[vtype]
                return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)
            if vtype == _STRING:
                return string(p)
            if vtype != _ARRAY:
                raise SyncdropError(f"model file {path}: unknown GGUF metadata type {vtype}")
            etype, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if etype in _SCALAR_FMT:
                fmt = _SCALAR_FMT[etype]
                width = struct.calcsize(fmt)
                return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, p)), p + count * width
            if etype == _STRING and not keep_strings:
                for _ in range(count):  # variable length: walk the lengths only
                    (n,) = struct.unpack_from("<Q", buf, p)
                    p += 8 + n
                return count, p
            items = []
            for _ in range(count):
                item, p = value(p, etype, keep_strings)
                items.append(item)
            return items, p

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = value(pos + 4, vtype, key in keep)

        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (ndim,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
            pos += 4 + 8 * ndim + 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        align = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (pos + align - 1) // align * align

        tensors = {}
        for name, shape, ggml_type, offset in infos:
            nbytes = _nbytes(ggml_type, shape, path, name)
            start = data_start + offset
            if start + nbytes > len(buf):
                raise SyncdropError(f"model file {path}: tensor {name} runs past the end of the file (truncated?)")
            tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, nbytes)
        return cls(path, version, metadata, tensors)

    def raw(self, name: str) -> torch.Tensor:
        """Dequantised float32 tensor ``name`` in torch order (reads only its bytes)."""
        info = self.tensors[name]
        qtype, block, type_size = _quant(info.ggml_type)
        data = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = math.prod(info.shape[:-1])
        return _dequantize(data.reshape(rows, info.shape[-1] // block * type_size), qtype).reshape(info.shape)

    def raw_rows(self, name: str, rows: np.ndarray) -> torch.Tensor:
        """``raw(name)[rows]`` (dim 0; elements of a 1-D tensor), reading and dequantising only the
        stored rows that ``rows`` names.

        ``rows``: 1-D int64 array of in-range, non-negative indices, any order, repeats allowed. A
        1-D tensor is read in whole quantisation blocks (one element per block for F32/F16/BF16).
        """
        info = self.tensors[name]
        qtype, block, type_size = _quant(info.ggml_type)
        rows = np.asarray(rows, dtype=np.int64)
        if len(info.shape) == 1:
            per_unit, unit_bytes, units = block, type_size, rows // block
        else:
            per_unit = math.prod(info.shape[1:])
            unit_bytes, units = per_unit // block * type_size, rows
        if rows.size == 0:
            return torch.empty((0, *info.shape[1:]), dtype=torch.float32)
        uniq, inverse = np.unique(units, return_inverse=True)
        table = self._table(info, (info.nbytes // unit_bytes, unit_bytes))
        lo, hi = int(uniq[0]), int(uniq[-1]) + 1
        data = table[lo:hi].copy() if hi - lo == uniq.size else table[uniq]
        del table
        vals = _dequantize(data, qtype).reshape(uniq.size, per_unit)
        if len(info.shape) == 1:
            return _select(vals.reshape(-1), inverse.reshape(-1) * block + rows % block)
        return _select(vals.reshape(uniq.size, *info.shape[1:]), inverse.reshape(-1))

    def raw_cols(self, name: str, cols: np.ndarray) -> torch.Tensor:
        """``raw(name)[:, cols]`` of a 2-D tensor, dequantising only the quantisation blocks (of
        every row) that hold the needed columns. ``cols`` as ``rows`` of :meth:`raw_rows`."""
        info = self.tensors[name]
        if len(info.shape) != 2:
            raise ValueError(f"{name}: column reads need a 2-D tensor, shape is {info.shape}")
        qtype, block, type_size = _quant(info.ggml_type)
        cols = np.asarray(cols, dtype=np.int64)
        n_rows, n_cols = info.shape
        if cols.size == 0:
            return torch.empty((n_rows, 0), dtype=torch.float32)
        uniq, inverse = np.unique(cols // block, return_inverse=True)
        table = self._table(info, (n_rows, n_cols // block, type_size))
        lo, hi = int(uniq[0]), int(uniq[-1]) + 1
        data = table[:, lo:hi].copy() if hi - lo == uniq.size else table[:, uniq]
        del table
        vals = _dequantize(data.reshape(n_rows, uniq.size * type_size), qtype).reshape(n_rows, uniq.size * block)
        pos = inverse.reshape(-1) * block + cols % block
        if pos.size == vals.shape[1] and np.array_equal(pos, np.arange(pos.size)):
            return vals
        return vals[:, torch.from_numpy(pos)]

    def _table(self, info: GGUFTensorInfo, shape: tuple[int, ...]) -> np.ndarray:
        """Read-only view of ``info``'s stored bytes (memory-mapped, nothing read yet) as ``shape``."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=shape).view(np.ndarray)


def _quant(ggml_type: int) -> tuple[Any, int, int]:
    """``(GGMLQuantizationType, elements per block, bytes per block)``."""
    import gguf

    qtype = gguf.GGMLQuantizationType(ggml_type)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return qtype, block, type_size


def _dequantize(data: np.ndarray, qtype: Any) -> torch.Tensor:
    """Float32 values of ``data`` (uint8, ``(rows, whole blocks' bytes)``), shape ``(rows, elements)``."""
    import gguf

    data = np.ascontiguousarray(data)
    if qtype == gguf.GGMLQuantizationType.BF16:  # numpy has no bfloat16
        return torch.from_numpy(data).view(torch.bfloat16).float()
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))


def _select(vals: torch.Tensor, pos: np.ndarray) -> torch.Tensor:
    """``vals[pos]`` along dim 0, skipping the copy when ``pos`` is ``0..len(vals)-1``."""
    if pos.size == vals.shape[0] and np.array_equal(pos, np.arange(pos.size)):
        return vals
    return vals[torch.from_numpy(pos)]


def normalize_index(index: torch.Tensor, size: int, what: str) -> torch.Tensor:
    """``index`` as a 1-D int64 CPU tensor with negative entries wrapped, as torch indexing does.

    Raises ``TypeError`` unless ``index`` is 1-D of an integer dtype (not bool), and ``IndexError``
    if an entry lies outside ``[-size, size)``.
    """
    index = torch.as_tensor(index)
    if index.dim() != 1 or index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        raise TypeError(f"{what}: index must be a 1-D integer tensor, got {index.dtype} of shape "
                        f"{tuple(index.shape)}")
    index = index.to(device="cpu", dtype=torch.int64)
    if index.numel() and (int(index.min()) < -size or int(index.max()) >= size):
        bad = int(index.min()) if int(index.min()) < -size else int(index.max())
        raise IndexError(f"{what}: index {bad} is out of bounds for size {size}")
    return torch.where(index < 0, index + size, index)


def _nbytes(ggml_type: int, shape: tuple[int, ...], path: str, name: str) -> int:
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as e:
        raise SyncdropError(f"model file {path}: tensor {name} has unknown ggml type {ggml_type}") from e
    if shape[-1] % block:
        raise SyncdropError(f"model file {path}: tensor {name} row length {shape[-1]} is not a multiple "
                            f"of the {qtype.name} block size {block}")
    return math.prod(shape) // block * type_size


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: ``(n*d, ...)`` with rotary pairs interleaved per head
    back to HF's half-split layout. Works for weights ``(n*d, h)`` and biases ``(n*d,)``."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's permutation (HF -> GGUF layout); the inverse of :func:`unpermute_rows`."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES and parts[3] in ("weight", "bias"):
        suffix = _BLOCK_NAMES[parts[2]]
        return f"layers.{parts[1]}.{suffix}.{parts[3]}"
    return None


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata (``{arch}.*`` and ``tokenizer.ggml.*`` keys)."""
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise SyncdropError(f"model file {g.path}: GGUF architecture {arch!r} unsupported "
                            f"(expected one of {sorted(SUPPORTED_GGUF_ARCHS)})")
    if "rope_freqs.weight" in g.tensors:
        raise SyncdropError(f"model file {g.path}: has rope_freqs (Llama-3.1-style rope scaling), which the "
                            "GGUF loader does not support; use the transformers checkpoint instead")
    if md.get(f"{arch}.expert_count", 0):
        raise SyncdropError(f"model file {g.path}: mixture-of-experts GGUF models are not supported")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in md:
            raise SyncdropError(f"model file {g.path}: GGUF metadata lacks {arch}.{key}")
        return md[f"{arch}.{key}"]

    if "token_embd.weight" not in g.tensors:
        raise SyncdropError(f"model file {g.path}: GGUF has no token_embd.weight tensor")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = md.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files
        if len(set(kv_heads)) != 1:
            raise SyncdropError(f"model file {g.path}: per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    head_dim = md.get(f"{arch}.attention.key_length") or md.get(f"{arch}.rope.dimension_count") or hidden // heads
    scaling = None
    stype = md.get(f"{arch}.rope.scaling.type")
    if stype not in (None, "none"):
        scaling = {"rope_type": stype, "factor": md.get(f"{arch}.rope.scaling.factor")}
        if f"{arch}.rope.scaling.original_context_length" in md:
            scaling["original_max_position_embeddings"] = md[f"{arch}.rope.scaling.original_context_length"]
    hf_arch, permuted = SUPPORTED_GGUF_ARCHS[arch]
    return ModelConfig(
        family="llama",
        arch=hf_arch,
        vocab_size=g.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        intermediate_size=int(need("feed_forward_length")),
        norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        act="silu",
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_positions=int(md.get(f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in g.tensors,
        qkv_bias="blk.0.attn_q.bias" in g.tensors,
        o_bias="blk.0.attn_output.bias" in g.tensors,
        mlp_bias="blk.0.ffn_up.bias" in g.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        extra={"gguf_arch": arch, "gguf_permuted_qk": permuted},
    )


class GGUFCheckpoint:
    """:class:`~syncdrop.models.loading.CheckpointReader` over one GGUF file."""

    def __init__(self, path: str) -> None:
        self.file = GGUFFile.open(path)
        self.config = config_from_gguf(self.file)
        self._permuted = bool(self.config.extra["gguf_permuted_qk"])
        self._index: dict[str, str] = {}  # canonical -> GGUF name
        for gname in self.file.tensors:
            cname = _canonical_name(gname)
            if cname is not None:
                self._index[cname] = gname

    def names(self) -> list[str]:
        return list(self._index)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of canonical tensor ``name`` without reading it."""
        return self.file.tensors[self._gguf_name(name)].shape

    def _gguf_name(self, name: str) -> str:
        if name not in self._index:
            raise KeyError(f"{name!r} not in {self.file.path}")
        return self._index[name]

    def _permuted_heads(self, name: str) -> int | None:
        """Head count of ``name`` if its rows are stored in llama.cpp's permuted q/k layout."""
        if self._permuted and name.startswith("layers."):
            proj = name.split(".")[2]
            if proj == "q":
                return self.config.num_heads
            if proj == "k":
                return self.config.num_kv_heads
        return None

    def get(self, name: str) -> torch.Tensor:
        w = self.file.raw(self._gguf_name(name))
        heads = self._permuted_heads(name)
        if heads is not None:
            w = unpermute_rows(w, heads)
        return w.contiguous()

    def get_rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """``get(name)[index]``, reading and dequantising only the stored rows needed.

        Permuted q/k weights and biases are read in whole heads (llama.cpp permutes rows only within
        a head): the heads that ``index`` touches are read, un-permuted one by one, then indexed, so
        any index works and a whole-heads index reads exactly its heads.
        """
        gname = self._gguf_name(name)
        shape = self.file.tensors[gname].shape
        idx = normalize_index(index, shape[0], name).numpy()
        heads = self._permuted_heads(name)
        if heads is None or idx.size == 0:
            return self.file.raw_rows(gname, idx).contiguous()
        d = shape[0] // heads
        uniq, inverse = np.unique(idx // d, return_inverse=True)
        rows = (uniq[:, None] * d + np.arange(d)).reshape(-1)
        w = unpermute_rows(self.file.raw_rows(gname, rows), uniq.size)
        return _select(w, inverse.reshape(-1) * d + idx % d).contiguous()

    def get_cols(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """``get(name)[:, index]`` of a 2-D tensor.

        Quantisation blocks run along columns, so every stored row is visited (about the same bytes
        read from disk as :meth:`get`), but only the blocks holding the needed columns are copied
        and dequantised: time and memory scale with the slice, not the tensor.
        """
        gname = self._gguf_name(name)
        shape = self.file.tensors[gname].shape
        if len(shape) != 2:
            raise IndexError(f"{name}: get_cols needs a 2-D tensor, shape is {shape}")
        w = self.file.raw_cols(gname, normalize_index(index, shape[1], name).numpy())
        heads = self._permuted_heads(name)
        if heads is not None:
            w = unpermute_rows(w, heads)
        return w.contiguous()
