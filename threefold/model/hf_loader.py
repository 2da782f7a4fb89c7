"""Reading a Hugging Face checkpoint directory: config.json, (sharded) safetensors,
generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from threefold.errors import ModelNotFoundError, ThreefoldError
from threefold.model.config import ModelArchConfig

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "do_sample")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} is not a model directory: it has no config.json")
    return json.loads(config_file.read_text())


def read_generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def sampling_defaults(generation: dict) -> dict:
    return {k: generation[k] for k in SAMPLING_KEYS if generation.get(k) is not None}


def as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def checkpoint_dtype(raw: dict) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ThreefoldError(f"checkpoint dtype {name!r} is not supported; pass dtype='bfloat16'", param="dtype")
    return _DTYPES[name]


def _architecture(raw: dict) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    raise ThreefoldError(
        f"unsupported architecture {names or raw.get('model_type')!r}; supported: {', '.join(HF_ARCHITECTURES)}",
        param="model",
    )


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None). transformers 5 writes `rope_parameters`
    (theta inside); older configs write `rope_theta` and `rope_scaling`."""
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = raw.get("rope_theta") or params.pop("rope_theta", None) or 10000.0
    params.pop("rope_theta", None)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    return float(theta), {**params, "rope_type": rope_type}


def hf_arch_config(raw: dict, dtype: torch.dtype) -> ModelArchConfig:
    try:
        return _hf_arch_config(raw, dtype)
    except KeyError as missing:
        raise ThreefoldError(f"config.json lacks required key {missing}", param="model") from None


def _hf_arch_config(raw: dict, dtype: torch.dtype) -> ModelArchConfig:
    arch = _architecture(raw)
    if raw.get("mlp_bias"):
        raise ThreefoldError("mlp_bias=True checkpoints are not supported", param="model")
    hidden, num_heads = raw["hidden_size"], raw["num_attention_heads"]
    theta, scaling = _rope(raw)
    sliding = raw.get("sliding_window") if arch == "mistral" or raw.get("use_sliding_window") else None
    return ModelArchConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases (hard-wired in its HF modeling code).
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        dtype=dtype,
        sliding_window=sliding,
        bos_token_id=raw.get("bos_token_id"),
    )


class SafetensorsSource:
    """Tensors of a single-file or sharded safetensors checkpoint, memory-mapped by
    safe_open; use as a context manager so the file handles close after loading."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ModelNotFoundError(f"{path} has no *.safetensors weights (only safetensors are supported)")
            weight_map = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), file.name))
        self.path = path
        self.weight_map = weight_map
        self.files = [path / name for name in sorted(set(weight_map.values()))]
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, dtype: torch.dtype) -> Tensor:
        file = self.weight_map.get(name)
        if file is None:
            raise ThreefoldError(f"checkpoint {self.path} is missing tensor {name!r}", param="model")
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, framework="pt")
        return self._handles[file].get_tensor(name).to(dtype)
