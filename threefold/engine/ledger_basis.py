"""The savings ledger's pricing basis for a loaded engine: its step-cost model and KV bytes per token.

The cost model is the speculative decoder's own StepCostModel when adaptive
speculation runs (refined online there), else one profiled at startup with the
same routine (threefold.spec.decoder.profile_step_cost), so both are measured alike.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.ledger import CostBasis
from threefold.ledger.entry import TECHNIQUE_CODEC, TECHNIQUE_PREFIX, TECHNIQUE_SPEC


def cost_basis(engine: Any) -> CostBasis | None:
    """What the ledger prices a loaded LLMEngine's requests with (None without a model runner)."""
    core = getattr(engine, "core", None)
    runner = getattr(core, "runner", None)
    if core is None or runner is None:
        return None
    config, block_size = runner.config, runner.block_size
    dtype_codec = make_codec("auto", config.num_kv_heads, config.head_dim, config.dtype)
    dtype_bytes = PagedKVCache.bytes_per_block(dtype_codec, config.num_layers, block_size) / block_size
    controller = runner.spec.decoder.controller if runner.spec is not None else None
    cost = controller.cost if controller is not None else _profile(runner.model)
    techniques = []
    if core.kv.enable_caching:
        techniques.append(TECHNIQUE_PREFIX)
    if runner.spec is not None:
        techniques.append(TECHNIQUE_SPEC)
    if runner.kv_cache_dtype != "auto":
        techniques.append(TECHNIQUE_CODEC)
    return CostBasis(cost, runner.bytes_per_block() / block_size, dtype_bytes, runner.kv_cache_dtype,
                     tuple(techniques), _draft_seconds(controller))


_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Loaded model -> its profiled cost model: engines sharing one model (tests, replicas) profile it once."""


def _profile(model: Any) -> Any:
    from threefold.spec.decoder import profile_step_cost
    from threefold.spec.runner import _dense_forward

    if model not in _PROFILES:
        with torch.inference_mode():
            _PROFILES[model] = profile_step_cost(lambda n: _dense_forward(model, n))
    return _PROFILES[model]


def _draft_seconds(controller: Any) -> Any:
    if controller is None:
        return lambda: 0.0
    return lambda: controller.draft_seconds_per_token
