"""Random GGUF checkpoints written without any model: a Llama of a given
shape whose 2-D weights are random blocks of a quantized type (fp16 scales
set so the weights are of order 0.1), norms F32, no tokenizer. The GGUF
tests build their files with it (K-quants included: ``gguf`` cannot
quantize to those, so the blocks are random bits), and
``tools/bench_quant.py --engine-gpu`` a large one to time decode.

    write_random_gguf(path, Q.Q4_K, hidden=2048, inter=5632, layers=22, ...) -> tensor bytes
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# fp16 fields of each packed type: byte offset -> magnitude, so weights come out of order 0.1
# (q ranges: Q8_0 +-128, Q4 16, Q5 32, K-quant sub-scales 0..63 times q 0..15 (Q4_K) / 0..31, Q6_K int8 x +-32)
RANDOM_FIELDS = {"Q8_0": {0: 2e-3}, "Q4_0": {0: 2e-2}, "Q5_0": {0: 1e-2}, "Q4_1": {0: 2e-2, 2: 0.1},
                 "Q5_1": {0: 1e-2, 2: 0.1}, "Q4_K": {0: 5e-4, 2: 5e-4}, "Q5_K": {0: 2.5e-4, 2: 5e-4},
                 "Q6_K": {208: 1e-4}, "Q3_K": {108: 1e-3}}  # Q3_K: a type kvstrata does not pack


def random_quant_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: random bits in ``qtype``'s blocks, fp16 scales
    set to give weights of order 0.1 (built by hand: gguf cannot write K-quants)."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at, mag in RANDOM_FIELDS[qtype.name].items():
        value = (rng.uniform(0.5, 1.0, n) * mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)
        blocks[:, at:at + 2] = value.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def write_random_gguf(path: Path | str, qtype: Q, *, hidden: int = 256, inter: int = 512, layers: int = 2,
                      heads: int = 4, kv_heads: int = 2, vocab: int = 320, tied: bool = True,
                      types: dict[str, Q] | None = None, seed: int = 0, context_length: int = 256) -> int:
    """A random Llama GGUF whose 2-D weights are random ``qtype`` blocks
    (``types``: GGUF tensor name -> another type for that one), norms F32.
    Returns the bytes of its tensors."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, context_length), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, inter), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, vocab), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2)):
        add(value)
    head_dim = hidden // heads
    shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,)}
    if not tied:
        shapes["output"] = (vocab, hidden)
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q": (hidden, hidden), f"blk.{i}.attn_k": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v": (kv_heads * head_dim, hidden), f"blk.{i}.attn_output": (hidden, hidden),
                       f"blk.{i}.ffn_gate": (inter, hidden), f"blk.{i}.ffn_up": (inter, hidden),
                       f"blk.{i}.ffn_down": (hidden, inter), f"blk.{i}.attn_norm": (hidden,),
                       f"blk.{i}.ffn_norm": (hidden,)})
    total = 0
    for stem, shape in shapes.items():
        if len(shape) == 1:
            data = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            w.add_tensor(f"{stem}.weight", data)
        else:
            t = (types or {}).get(f"{stem}.weight", qtype)
            if t in (Q.F32, Q.F16):
                data = (rng.standard_normal(shape) * 0.1).astype(np.float32 if t == Q.F32 else np.float16)
                w.add_tensor(f"{stem}.weight", data)
            else:
                data = random_quant_blocks(t, *shape, rng)
                w.add_tensor(f"{stem}.weight", data, raw_shape=data.shape, raw_dtype=t)
        total += data.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total
