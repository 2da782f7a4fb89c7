"""threefold: an LLM inference engine and serving stack."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "ThreefoldError", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import threefold` (and the CLI's --help) does not import torch.
    if name == "LLM":
        from threefold.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from threefold.sample.params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from threefold.engine import outputs
        return getattr(outputs, name)
    if name == "ThreefoldError":
        from threefold.errors import ThreefoldError
        return ThreefoldError
    raise AttributeError(f"module 'threefold' has no attribute {name!r}")
