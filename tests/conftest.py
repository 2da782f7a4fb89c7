"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import pytest

from threefold.engine.llm import LLM
from threefold.engine.llm_engine import EngineArgs, LLMEngine

from redis_fixture import redis_server  # noqa: F401 - a real Redis for the KV tier tests


@pytest.fixture(scope="session")
def smollm2_fp32():
    """SmolLM2-135M-Instruct from its real GGUF, dequantized to fp32 (exact comparisons)."""
    from threefold.model.loader import load_model
    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def make_llm(smollm2_fp32):
    """Build an LLM over the shared fp32 weights with any engine settings."""
    def make(**engine_args) -> LLM:
        engine_args.setdefault("kv_cache_memory", 256 << 20)
        engine_args.setdefault("max_model_len", 1024)
        return LLM.from_engine(LLMEngine(smollm2_fp32, EngineArgs(dtype="float32", **engine_args)))
    return make
