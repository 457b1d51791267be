"""Read a GGUF checkpoint (llama.cpp's format) as a Hugging Face one: a
config dict shaped like config.json and tensors under HF names, dequantized
to the requested dtype one tensor at a time (F32, F16, BF16, Q4_0, Q4_1,
Q5_0, Q5_1 and Q8_0 here; the K-quants and any other type ``gguf.quants``
dequantizes through it). GGUF architectures ``llama`` (Llama, and Mistral
as llama.cpp converts it), ``qwen2`` and ``qwen3`` map to LlamaForCausalLM,
Qwen2ForCausalLM and Qwen3ForCausalLM.

llama.cpp stores Llama's q and k projections (weights and biases) permuted
for its RoPE layout (its Qwen files use the NeoX layout, unpermuted); they
are permuted back, so the tensors equal the original checkpoint's
(dequantization aside). The tokenizer, special tokens and chat template come
from the metadata (``kvstrata.text.gguf_tokenizer``).

Start-up time is why this file parses GGUF itself rather than through
``gguf.GGUFReader``, which makes a numpy memmap view per metadata string
(SmolLM2's 49k tokens and 49k merges: 3-7 s on a busy 2-core host) and hands
tensors over as memmaps, on which ``gguf.quants`` (16 rows per Python call,
each slice a memmap) took 4-5 s for SmolLM2. Here the header is parsed with
``struct`` over one mmap (0.1-0.2 s) and each tensor is dequantized from the
mmap straight into the model's parameter (``GGUFTensor.read_into``, no
intermediate copy; 0.4-0.7 s), with the values ``gguf.quants`` gives
(tests/model_gguf compare them). With packed weights
(``model.quantized_weights``) the linear layers' blocks are copied as they
are instead (``GGUFTensor.pack``).

Errors (``CheckpointError``) name the file and what is wrong: not a GGUF,
truncated, an architecture or tensor type this reader does not map.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvstrata.kernels import KernelArgumentError, PackedWeight, pack_weight, quant_type
from kvstrata.text.gguf_tokenizer import GGUFMetadata, GGUFValue
from kvstrata.worker.model.config import CheckpointError, HFConfig

# GGUF architecture -> HF architecture; and which ones llama.cpp stores with q/k permuted
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_PERMUTED_QK = {"llama"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_FREQS = "rope_freqs.weight"  # per-dimension frequency divisors (llama.cpp's Llama 3 scaling)


class GGUFCheckpoint:
    """Owns: the file's mmap and what its header says (metadata, tensor index)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise CheckpointError(f"model: {str(self.path)!r} is not a file")
        with self.path.open("rb") as f:
            head = f.read(4)
            if head != b"GGUF":
                raise CheckpointError(f"model: {str(self.path)!r} is not a GGUF file "
                                      f"(it starts with {head!r}, not b'GGUF')")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            values, infos = _read_header(self._mm)
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
            raise CheckpointError(self._corrupt(e)) from None
        self._meta = _Metadata(values)
        self.arch_name = self.string("general.architecture")
        if self.arch_name not in _ARCHS:
            raise CheckpointError(f"model: {self.path.name!r}: GGUF architecture {self.arch_name!r} is not supported "
                                  f"(supported: {sorted(_ARCHS)})")
        self._tensors = {t.name: t for t in infos}
        self._config: HFConfig | None = None

    def _corrupt(self, e: Exception) -> str:
        return (f"model: {str(self.path)!r} is a truncated or corrupt GGUF file ({self.path.stat().st_size} bytes): "
                f"{type(e).__name__}: {e}")

    # -- metadata ---------------------------------------------------------------
    @property
    def metadata(self) -> GGUFMetadata:
        """The file's metadata, read once (the tokenizer is built from it too)."""
        return self._meta

    def field(self, key: str, default: GGUFValue = None) -> GGUFValue:
        return self._meta.get(key, default)

    def string(self, key: str) -> str:
        v = self.field(key)
        if not isinstance(v, str):
            raise CheckpointError(f"model: {self.path.name!r} has no {key!r} metadata")
        return v

    def _need(self, key: str) -> GGUFValue:
        v = self.field(f"{self.arch_name}.{key}")
        if v is None:
            raise CheckpointError(f"model: {self.path.name!r} is missing metadata {self.arch_name}.{key}")
        return v

    def hf_config(self) -> HFConfig:
        """What config.json would say."""
        if self._config is None:
            self._config = self._hf_config()
        return dict(self._config)

    def _hf_config(self) -> HFConfig:
        heads = int(self._need("attention.head_count"))
        hidden = int(self._need("embedding_length"))
        vocab = self.field(f"{self.arch_name}.vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        cfg: HFConfig = {
            "architectures": [_ARCHS[self.arch_name]],
            "hidden_size": hidden,
            "intermediate_size": int(self._need("feed_forward_length")),
            "num_hidden_layers": int(self._need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{self.arch_name}.attention.head_count_kv") or heads),
            "head_dim": int(self.field(f"{self.arch_name}.attention.key_length") or hidden // heads),
            "rms_norm_eps": float(self._need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.field(f"{self.arch_name}.rope.freq_base") or 10000.0),
            "max_position_embeddings": int(self.field(f"{self.arch_name}.context_length") or 2048),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "torch_dtype": "float32",
        }
        if self.arch_name in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False  # llama.cpp records no window for these
        scaling = self._rope_scaling()
        if scaling is not None:
            cfg["rope_scaling"] = scaling
        if _ROPE_FREQS in self._tensors:
            info = self._tensors[_ROPE_FREQS]
            factors = np.empty(info.shape, np.float32)
            _dequantize(self, info, factors)
            cfg["rope_freq_factors"] = [float(f) for f in factors.reshape(-1)]
        for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            value = self.field(name)
            if value is not None:
                cfg[key] = int(value)
        # end of turn / end of message end a reply too
        ends = [cfg.get("eos_token_id"), self.field("tokenizer.ggml.eot_token_id"),
                self.field("tokenizer.ggml.eom_token_id")]
        ends = list(dict.fromkeys(int(e) for e in ends if e is not None))
        if len(ends) > 1:
            cfg["eos_token_id"] = ends
        return cfg

    def _rope_scaling(self) -> dict[str, object] | None:
        """llama.cpp's ``{arch}.rope.scaling.*`` as config.json's rope_scaling:
        "linear" (positions divided by ``factor``) and "yarn" (with its
        ``original_context_length``; llama.cpp multiplies yarn's attention
        factor by ``attn_factor``). None without scaling."""
        kind = self.field(f"{self.arch_name}.rope.scaling.type")
        if kind in (None, "none"):
            return None
        factor = self.field(f"{self.arch_name}.rope.scaling.factor")
        if kind not in ("linear", "yarn") or not isinstance(factor, (int, float)) or factor <= 0:
            raise CheckpointError(f"model: {self.path.name!r} has rope scaling {kind!r} (factor {factor!r}); "
                                  "supported: 'linear' and 'yarn' with a positive factor")
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        orig = self.field(f"{self.arch_name}.rope.scaling.original_context_length")
        if not isinstance(orig, int) or orig < 1:
            raise CheckpointError(f"model: {self.path.name!r} has yarn rope scaling without "
                                  f"{self.arch_name}.rope.scaling.original_context_length")
        out: dict[str, object] = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": orig}
        for key, default in (("yarn_log_multiplier", 0.0), ("yarn_attn_factor", 1.0)):
            value = self.field(f"{self.arch_name}.rope.scaling.{key}")
            if value is not None and value != default:
                raise CheckpointError(f"model: {self.path.name!r} has {self.arch_name}.rope.scaling.{key} = "
                                      f"{value!r}, which kvstrata does not run")
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = self.field(f"{self.arch_name}.rope.scaling.{key}")
            if isinstance(value, (int, float)) and value > 0:
                out[hf] = float(value)
        attn = self.field(f"{self.arch_name}.rope.scaling.attn_factor")
        if isinstance(attn, (int, float)) and attn != 1.0:
            out["attention_factor"] = float(attn) * (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
        return out

    # -- tensors ------------------------------------------------------------------
    def tensor_sources(self) -> Iterator[tuple[str, GGUFTensor]]:
        """(HF name, ``GGUFTensor``) for every tensor: its shape now, its
        values when ``read_into`` is called (the loader dequantizes straight
        into the model's parameter)."""
        cfg = self.hf_config()
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
        for name, info in self._tensors.items():
            if name == _ROPE_FREQS:
                continue  # the frequencies' divisors: in hf_config, not a weight
            hf = _hf_name(name)
            if hf is None:
                raise CheckpointError(f"model: {self.path.name!r} has tensor {name!r}, which a "
                                      f"{_ARCHS[self.arch_name]} does not use")
            permute = None
            if self.arch_name in _PERMUTED_QK and hf.split(".")[-2] in heads:
                permute = heads[hf.split(".")[-2]]
            yield hf, GGUFTensor(self, info, permute)

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor in ``dtype``) for every tensor, dequantized lazily."""
        for hf, src in self.tensor_sources():
            out = torch.empty(src.shape, dtype=torch.float32)
            src.read_into(out)
            yield hf, out.to(dtype)


class GGUFTensor:
    """One tensor of a GGUF file, read on demand. ``shape``: its HF shape;
    ``gguf_name``, ``ggml_type`` (the type id), ``nbytes``: as in the file."""

    def __init__(self, ck: GGUFCheckpoint, info: _TensorInfo, permute_heads: int | None) -> None:
        self._ck, self._info, self._heads = ck, info, permute_heads
        self.shape = info.shape
        self.gguf_name = info.name
        self.ggml_type = info.qtype
        self.nbytes = info.nbytes  # in the file

    @property
    def type_name(self) -> str:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self._info.qtype).name

    def pack(self, device: torch.device | str) -> PackedWeight:
        """The tensor's quantized blocks, kept (``kvstrata.kernels.pack_weight``):
        a copy on ``device`` owning its memory, llama.cpp's q/k permutation
        undone by moving whole rows (blocks never straddle rows).
        KernelArgumentError when its type or shape is not one that packs."""
        if len(self.shape) != 2:
            raise KernelArgumentError(f"{self.gguf_name} has shape {self.shape}: only 2-D weights pack")
        quant_type(self._info.qtype)  # an unpacked type fails here, before the copy
        raw = np.frombuffer(self._ck._mm, dtype=np.uint8, count=self._info.nbytes, offset=self._info.offset)
        packed = pack_weight(torch.from_numpy(raw.copy()), self._info.qtype, self.shape, device)
        if self._heads is None:
            return packed
        n, rows = self._heads, self.shape[0]  # rows (head, r, pair) -> (head, pair, r), as read_into
        return packed.rows(torch.arange(rows, device=packed.device).view(n, rows // n // 2, 2).transpose(1, 2).reshape(-1))

    def read_into(self, out: torch.Tensor) -> None:
        """Dequantize into ``out`` (this shape, any float dtype, any device),
        undoing llama.cpp's q/k permutation; a float32 CPU ``out`` is
        written in place, with no intermediate copy."""
        in_place = out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
        target = out.numpy() if in_place else np.empty(self.shape, np.float32)
        if self._heads is None:
            _dequantize(self._ck, self._info, target)
        else:  # (heads, rows/2, 2, ...) -> (heads, 2, rows/2, ...)
            values = np.empty(self.shape, np.float32)
            _dequantize(self._ck, self._info, values)
            n, rows, rest = self._heads, self.shape[0], self.shape[1:]
            target.reshape(n, 2, rows // n // 2, *rest)[...] = values.reshape(n, rows // n // 2, 2, *rest).swapaxes(1, 2)
        if not in_place:
            out.copy_(torch.from_numpy(target))


# -- the header ------------------------------------------------------------------------

class _TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # row-major (HF order: ggml's dims reversed)
    qtype: int
    offset: int  # absolute, in the file
    nbytes: int


class _Metadata(GGUFMetadata):
    """The metadata as plain values, parsed here (``GGUFMetadata`` reads a
    ``gguf.GGUFReader``'s fields: the slow path this file avoids)."""

    def __init__(self, values: dict[str, GGUFValue]) -> None:  # not super().__init__: it takes a reader
        self._values = values

    def get(self, key: str, default: GGUFValue = None) -> GGUFValue:
        return self._values.get(key, default)


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def u32(self) -> int:
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self) -> bytes:
        n = self.u64()
        s = self.buf[self.pos:self.pos + n]
        if len(s) != n:
            raise ValueError(f"a string of {n} bytes at offset {self.pos} runs past the end")
        self.pos += n
        return s

    def value(self, vtype: int) -> GGUFValue:
        if vtype == _STRING:
            return self.raw_string().decode("utf-8")
        if vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype == _STRING:
                return [self.raw_string().decode("utf-8", errors="replace") for _ in range(count)]
            if etype in _NUMPY:
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]  # arrays of arrays
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {vtype} at offset {self.pos}")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v


def _read_header(buf: mmap.mmap) -> tuple[dict[str, GGUFValue], list[_TensorInfo]]:
    """The metadata (key -> plain value) and the tensor index of a
    little-endian GGUF v2/v3 file; ValueError / struct.error when it is
    cut short or malformed."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cursor(buf)
    cur.pos = 4  # b"GGUF"
    version = cur.u32()
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian, or not 2 or 3) is not supported")
    num_tensors, num_kv = cur.u64(), cur.u64()
    values: dict[str, GGUFValue] = {"GGUF.version": version, "GGUF.tensor_count": num_tensors, "GGUF.kv_count": num_kv}
    for _ in range(num_kv):
        key = cur.raw_string().decode("utf-8")
        values[key] = cur.value(cur.u32())
    raw_infos = []
    for _ in range(num_tensors):
        name = cur.raw_string().decode("utf-8")
        dims = [cur.u64() for _ in range(cur.u32())]
        raw_infos.append((name, dims, cur.u32(), cur.u64()))
    align = values.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    data_start = -(-cur.pos // align) * align
    infos, seen = [], set()
    for name, dims, qtype, offset in raw_infos:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {qtype}") from None
        numel = int(np.prod(dims, dtype=np.int64)) if dims else 1
        info = _TensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype, data_start + offset,
                           numel // block * type_size)
        if info.offset + info.nbytes > len(buf):
            raise ValueError(f"tensor {name!r} ends at byte {info.offset + info.nbytes}, past the end of the file")
        infos.append(info)
    return values, infos


# -- dequantization --------------------------------------------------------------------------
#
# Whole tensors, numpy, single-threaded, from the mmap into the output. One
# block of 32 weights per row of ``b`` (uint8 [n_blocks, bytes]):
#   Q8_0  d:f16 | 32 x int8                         w = q * d
#   Q4_0  d:f16 | 16 bytes: low, then high nibbles   w = (q - 8) * d
#   Q4_1  d:f16 m:f16 | 16 bytes                     w = q * d + m
#   Q5_0  d:f16 | qh:4 bytes | 16 bytes              q = nibble + 16 * (bit j of qh); w = (q - 16) * d
#   Q5_1  d:f16 m:f16 | qh:4 bytes | 16 bytes        w = q * d + m
# The arithmetic and its order are gguf.quants' (float32 multiply, then
# add), so the values are identical. Other types (the K-quants, ...) go to
# gguf.quants itself, fast on a plain array (its slow part was the memmap
# gguf.GGUFReader hands it). Not torch (``kvstrata.kernels.quant`` has the
# same formats): on a busy host torch's spinning OpenMP threads made the
# same work 17 s instead of 0.5 s unless OMP_WAIT_POLICY=PASSIVE.

def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[:, at:at + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, o: np.ndarray) -> None:
    half = qs.shape[1]
    np.bitwise_and(qs, 15, out=o[:, :half], casting="unsafe")
    np.right_shift(qs, 4, out=o[:, half:], casting="unsafe")


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """16 * bit j of each block's little-endian 32-bit ``qh``, per weight [n, 32]."""
    return (((qh[:, :, None] >> np.arange(8, dtype=np.uint8)) & 1) << 4).reshape(qh.shape[0], 32)


def _q8_0(b: np.ndarray, o: np.ndarray) -> None:
    o[...] = b[:, 2:].view(np.int8)
    o *= _f16(b, 0)


def _q4_0(b: np.ndarray, o: np.ndarray) -> None:
    _nibbles(b[:, 2:], o)
    o -= 8
    o *= _f16(b, 0)


def _q4_1(b: np.ndarray, o: np.ndarray) -> None:
    _nibbles(b[:, 4:], o)
    o *= _f16(b, 0)
    o += _f16(b, 2)


def _q5_0(b: np.ndarray, o: np.ndarray) -> None:
    _nibbles(b[:, 6:], o)
    o += _high_bits(b[:, 2:6])
    o -= 16
    o *= _f16(b, 0)


def _q5_1(b: np.ndarray, o: np.ndarray) -> None:
    _nibbles(b[:, 8:], o)
    o += _high_bits(b[:, 4:8])
    o *= _f16(b, 0)
    o += _f16(b, 2)


# ggml type id -> (bytes per block of 32, dequantizer of [n_blocks, bytes] into float32 [n_blocks, 32])
_BLOCKWISE: dict[int, tuple[int, Callable[[np.ndarray, np.ndarray], None]]] = {
    8: (34, _q8_0), 2: (18, _q4_0), 3: (20, _q4_1), 6: (22, _q5_0), 7: (24, _q5_1),  # Q8_0 Q4_0 Q4_1 Q5_0 Q5_1
}
_PLAIN = {0: np.float32, 1: np.float16}  # F32, F16
_BF16 = 30


def _dequantize(ck: GGUFCheckpoint, info: _TensorInfo, out: np.ndarray) -> None:
    """``info``'s values into ``out`` (float32, contiguous, its shape)."""
    raw = np.frombuffer(ck._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    flat = out.reshape(-1)
    if info.qtype in _PLAIN:
        flat[...] = raw.view(_PLAIN[info.qtype])
    elif info.qtype == _BF16:  # the high half of a float32
        bits = flat.view(np.uint32)
        bits[...] = raw.view(np.uint16)
        bits <<= 16
    elif info.qtype in _BLOCKWISE:
        size, fn = _BLOCKWISE[info.qtype]
        fn(raw.reshape(-1, size), out.reshape(-1, 32))
    else:
        out[...] = _dequantize_other(ck, info, raw).reshape(out.shape)


def _dequantize_other(ck: GGUFCheckpoint, info: _TensorInfo, raw: np.ndarray) -> np.ndarray:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.qtype)
    try:
        return dequantize(raw.reshape(info.shape[:-1] + (-1,)), qtype)
    except NotImplementedError:
        raise CheckpointError(f"model: {ck.path.name!r}: tensor {info.name!r} has type "
                              f"{qtype.name}, which cannot be dequantized") from None


def _hf_name(name: str) -> str | None:
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")
