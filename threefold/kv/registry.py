"""The codec registry: spec text -> a codec instance for one model's KV geometry."""

from __future__ import annotations

import torch

from threefold.kv.codec import DenseCodec, KVCodec
from threefold.kv.codecs.gear import GearCodec
from threefold.kv.codecs.kivi import KiviCodec
from threefold.kv.codecs.scaled import Fp8Codec, Int4Codec, Int8Codec
from threefold.kv.codecs.tiered import TieredCodec
from threefold.kv.codecs.turboquant import TurboQuantCodec
from threefold.kv.spec import KVSpec, parse_kv_spec

CODECS: dict[str, type[KVCodec]] = {
    "auto": DenseCodec,
    "int8": Int8Codec,
    "fp8_e4m3": Fp8Codec,
    "fp8_e5m2": Fp8Codec,
    "int4": Int4Codec,
    "kivi2": KiviCodec,
    "kivi4": KiviCodec,
    "gear": GearCodec,
    "turboquant": TurboQuantCodec,
    "tiered": TieredCodec,
}


def make_codec(spec: KVSpec | str, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype) -> KVCodec:
    """A codec for `spec` (text is parsed and validated; errors list the choices)."""
    resolved = parse_kv_spec(spec) if isinstance(spec, str) else spec
    return CODECS[resolved.name](resolved, num_kv_heads, head_dim, compute_dtype)
