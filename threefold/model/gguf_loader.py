"""Reading a GGUF file: architecture config, dequantized tensors under HF names, tokenizer.

Weights are dequantized once at load time (gguf.quants, numpy) into the compute
dtype; we do not run quantized kernels. llama-architecture files store q/k rows
permuted for llama.cpp's interleaved rotary layout and are un-permuted here
(transformers' LlamaTensorProcessor); qwen2/qwen3 files are stored as in HF.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

try:  # the per-type dequantizers behind gguf.quants.dequantize (gguf is pinned to 0.19)
    from gguf.quants import _type_traits as _QUANT_TYPES
except ImportError:  # pragma: no cover
    _QUANT_TYPES = {}
from torch import Tensor

from threefold.errors import ModelNotFoundError, ThreefoldError
from threefold.model.assemble import GGUF_MAGIC
from threefold.model.config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from threefold.model.gguf_file import GGUFFile

# HF name piece -> GGUF name piece, for everything under model.layers.{i}.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
DEQUANT_CHUNK_VALUES = 1 << 18
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def gguf_name(hf_name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight'."""
    if m := _LAYER_RE.fullmatch(hf_name):
        return f"blk.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    stem, suffix = hf_name.rsplit(".", 1)
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def open_gguf(path: Path) -> GGUFFile:
    """Open (memory-map) a GGUF file, with errors that say what is wrong with it."""
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ThreefoldError(f"{path} is not a GGUF file (bad magic)", param="model")
    try:
        return GGUFFile(path)
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise ThreefoldError(f"{path} is not a valid GGUF file: {err}", param="model") from None


def metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def gguf_arch_config(reader: GGUFFile, dtype: torch.dtype) -> ModelArchConfig:
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ThreefoldError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}", param="model"
        )
    tensor_names = {t.name for t in reader.tensors}
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ThreefoldError(
            f"GGUF rope scaling ({scaling!r}, rope_freqs) is not supported; use the HF checkpoint instead",
            param="model",
        )
    hidden = int(metadata(reader, f"{arch}.embedding_length"))
    num_heads = int(metadata(reader, f"{arch}.attention.head_count"))
    vocab = metadata(reader, f"{arch}.vocab_size") or len(metadata(reader, "tokenizer.ggml.tokens", []))
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(metadata(reader, f"{arch}.feed_forward_length")),
        num_layers=int(metadata(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(metadata(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(metadata(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        dtype=dtype,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        extra={"name": metadata(reader, "general.name"), "file_type": metadata(reader, "general.file_type")},
    )


def gguf_is_full_precision(reader: GGUFFile) -> bool:
    """True when every matrix is stored in F32 (then dtype="auto" keeps float32)."""
    return all(t.tensor_type == GGMLQuantizationType.F32 for t in reader.tensors if len(t.shape) > 1)


def dequantize_rows(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's numpy dequantization, fed ~256k values at a time instead of 16 rows at a
    time (its default): ~2x faster, as the per-call overhead dominated. Returns a new
    writable float32 array [..., cols]."""
    quant = _QUANT_TYPES.get(qtype)
    if quant is None:  # F32/F16/BF16 and anything gguf handles only through its public API
        return np.array(dequantize(data, qtype), dtype=np.float32)
    quant.init_grid()
    rows = data.view(np.ndarray).reshape(-1, data.shape[-1])  # plain ndarray: memmap views are slow
    step = max(1, DEQUANT_CHUNK_VALUES // (rows.shape[1] * quant.block_size // quant.type_size))
    out = [quant.dequantize_rows(rows[i : i + step]) for i in range(0, rows.shape[0], step)]
    return np.concatenate(out).reshape(*data.shape[:-1], -1)


def _unpermute(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (dim/2, 2) -> (2, dim/2)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFTensorSource:
    """Dequantizes tensors on request, under HF names (see weights.TensorSource)."""

    def __init__(self, reader: GGUFFile, config: ModelArchConfig) -> None:
        self.tensors = {t.name: t for t in reader.tensors}
        self.config = config

    def has(self, name: str) -> bool:
        return gguf_name(name) in self.tensors

    def get(self, name: str, dtype: torch.dtype) -> Tensor:
        tensor = self.tensors.get(gguf_name(name))
        if tensor is None:
            raise ThreefoldError(f"GGUF file is missing tensor {gguf_name(name)!r} ({name})", param="model")
        weight = torch.from_numpy(dequantize_rows(tensor.data, tensor.tensor_type))  # float32 [rows, cols]
        if self.config.architecture == "llama":
            if name.endswith("q_proj.weight"):
                weight = _unpermute(weight, self.config.num_heads)
            elif name.endswith("k_proj.weight"):
                weight = _unpermute(weight, self.config.num_kv_heads)
        return weight.to(dtype)


def gguf_eos_token_ids(reader: GGUFFile) -> list[int]:
    """eos plus llama.cpp's end-of-turn / end-of-message ids where the file has them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [int(v) for k in keys if (v := metadata(reader, k)) is not None]


def gguf_chat_template(reader: GGUFFile) -> str | None:
    return metadata(reader, "tokenizer.chat_template")
