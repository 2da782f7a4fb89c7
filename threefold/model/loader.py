"""`load_model`: a registry name, GGUF file or HF directory -> a ready `LoadedModel`."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from threefold.cpu import cpu_info
from threefold.env import Env
from threefold.errors import ModelNotFoundError, ThreefoldError
from threefold.kernels import cpu_kernels, has_few_row_linear, has_int8_linear
from threefold.model import gguf_loader, hf_loader
from threefold.model.config import ModelArchConfig
from threefold.model.llama import CausalLM
from threefold.model.precision import Precision, resolve_precision
from threefold.model.tokenizer import Tokenizer
from threefold.model.weights import TensorSource, fused_state_dict

FINGERPRINT_HEAD_BYTES = 1 << 20
QUANTIZATIONS = (None, "int8")
"""Weight formats `load_model` can stream: the checkpoint's (None), or int8 (`build_model`)."""

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    """eval mode, no grads, computing in `config.dtype`, on the requested device."""
    config: ModelArchConfig
    tokenizer: Tokenizer
    generation_defaults: dict
    """Sampling defaults from generation_config.json, only the keys present; {} for GGUF."""
    eos_token_ids: list[int]
    """Every id that ends generation (config, generation_config and tokenizer eos)."""
    precision: Precision
    """The compute dtype and weight storage chosen for `dtype`, and why (logged at engine start)."""
    fingerprint: str
    """sha256 over weight file names, sizes, first MiB, and the numerics: stable across processes."""
    name: str
    """Registry name, or the file/directory name."""
    max_model_len: int
    """min(config.max_position_embeddings, the user's max_model_len)."""


def choose_precision(requested: str, checkpoint: torch.dtype, device: str) -> tuple[Precision, ModuleType | None]:
    """The precision for `requested` on this machine, and the CPU kernels the model will use."""
    kernels = cpu_kernels() if torch.device(device).type == "cpu" else None
    mixed_kernel = has_few_row_linear(kernels, torch.float32, torch.bfloat16)
    return resolve_precision(requested, checkpoint, device, cpu_info(), mixed_kernel), kernels


def fingerprint(files: list[Path], numerics: Precision | None, extra: bytes = b"") -> str:
    """sha256 of the numerics (compute dtype and weight storage), `extra`, and each file's name,
    size and first MiB."""
    digest = hashlib.sha256((numerics.key() if numerics else "None").encode() + extra)
    for path in sorted(files):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(FINGERPRINT_HEAD_BYTES))
    return digest.hexdigest()


def build_model(config: ModelArchConfig, source: TensorSource, max_len: int, device: str,
                precision: Precision, kernels: ModuleType | None, quantization: str | None = None) -> CausalLM:
    """Construct on the meta device (no random init), assign the checkpoint tensors, and lay
    the linear weights out for `precision` and `kernels` (quantization "int8": few-row calls
    stream int8 weights, `CausalLM.store_int8`)."""
    state = fused_state_dict(source, config)
    with torch.device("meta"):
        model = CausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ThreefoldError(f"weights do not match the model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.requires_grad_(False)
    model.eval().to(device)
    if precision.mixed:
        model.store_bf16()
    int8 = quantization == "int8" and has_int8_linear(kernels)
    if quantization == "int8" and not int8:
        logger.warning("quantization=int8 needs the native few-row kernel (AVX2), which this machine's build "
                       "lacks: the weights stay %s", precision.name)
    if int8:
        model.store_int8()
    # The few-row kernel streams the plain weights, where it runs over them; under bf16-weights (or
    # int8) it streams its own copy, so the plain weight is needed only packed, for GEMMs.
    streams_plain = (has_few_row_linear(kernels, precision.compute, precision.weights) and not precision.mixed
                     and not int8)
    model.pack_weights(keep_plain=streams_plain)
    model.use_kernels(kernels)
    model.init_rope(max_len)
    return model


def _max_len(config: ModelArchConfig, max_model_len: int | None) -> int:
    return min(config.max_position_embeddings, max_model_len or config.max_position_embeddings)


def _dedup(ids: list[int | None]) -> list[int]:
    return list(dict.fromkeys(i for i in ids if i is not None))


def _quant_tag(quantization: str | None) -> bytes:
    """The fingerprint's record of the weights' stream format (nothing for the default)."""
    return f"quantization={quantization}".encode() if quantization else b""


def load_gguf(path: Path, name: str, dtype: str, device: str, max_model_len: int | None,
              quantization: str | None = None) -> LoadedModel:
    reader = gguf_loader.open_gguf(path)
    checkpoint_dtype = torch.float32 if gguf_loader.gguf_is_full_precision(reader) else torch.bfloat16
    precision, kernels = choose_precision(dtype, checkpoint_dtype, device)
    config = gguf_loader.gguf_arch_config(reader, precision.compute)
    max_len = _max_len(config, max_model_len)
    model = build_model(config, gguf_loader.GGUFTensorSource(reader, config), max_len, device, precision, kernels,
                        quantization)
    file_id = fingerprint([path], None)
    tokenizer = Tokenizer.from_gguf(
        path, gguf_loader.gguf_chat_template(reader), cache_dir=Env.read().home / "tokenizers" / file_id[:32]
    )
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        generation_defaults={},
        eos_token_ids=_dedup([*gguf_loader.gguf_eos_token_ids(reader), tokenizer.eos_token_id,
                              *tokenizer.end_of_generation_ids()]),
        precision=precision,
        fingerprint=fingerprint([path], precision, extra=_quant_tag(quantization)),
        name=name,
        max_model_len=max_len,
    )


def load_hf_dir(path: Path, name: str, dtype: str, device: str, max_model_len: int | None,
                quantization: str | None = None) -> LoadedModel:
    raw = hf_loader.read_config(path)
    precision, kernels = choose_precision(dtype, hf_loader.checkpoint_dtype(raw), device)
    config = hf_loader.hf_arch_config(raw, precision.compute)
    max_len = _max_len(config, max_model_len)
    with hf_loader.SafetensorsSource(path) as source:
        model = build_model(config, source, max_len, device, precision, kernels, quantization)
        files = source.files
    tokenizer = Tokenizer.from_dir(path)
    generation = hf_loader.read_generation_config(path)
    eos = [*hf_loader.as_list(raw.get("eos_token_id")), *hf_loader.as_list(generation.get("eos_token_id"))]
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        generation_defaults=hf_loader.sampling_defaults(generation),
        eos_token_ids=_dedup([*eos, tokenizer.eos_token_id]),
        precision=precision,
        fingerprint=fingerprint(files, precision, extra=(path / "config.json").read_bytes() + _quant_tag(quantization)),
        name=name,
        max_model_len=max_len,
    )


def load_model(
    model: str, dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a registry name (pulled on first use), a .gguf file, or an HF checkpoint directory.
    quantization: None, or "int8" (`build_model`; a draft model's option, `SpeculativeConfig`)."""
    from threefold.model.registry import REGISTRY, resolve

    if max_model_len is not None and max_model_len <= 0:
        raise ThreefoldError(f"max_model_len must be positive, got {max_model_len}", param="max_model_len")
    if quantization not in QUANTIZATIONS:
        raise ThreefoldError(f"unknown quantization {quantization!r}; use one of "
                             f"{', '.join(str(q) for q in QUANTIZATIONS)}.", param="quantization")
    path = resolve(model)
    name = model if model in REGISTRY else path.name
    if path.is_dir():
        return load_hf_dir(path, name, dtype, device, max_model_len, quantization)
    if path.suffix == ".gguf" or path.is_file():
        return load_gguf(path, name, dtype, device, max_model_len, quantization)
    raise ModelNotFoundError(f"no model at {path}")
