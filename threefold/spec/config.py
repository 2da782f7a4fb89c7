"""SpeculativeConfig: the one speculative-decoding option, in vLLM's shape (plain Python, no torch).

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5}
    {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "quantization": "int8"}
    {"method": "eagle", "model": "<heads dir>", "num_speculative_tokens": 5, "tree_top_k": 4,
     "tree_total_tokens": 16}
    {"method": "medusa", "model": "<heads dir>", "speculative_token_tree": "[(0,), (1,), (0, 0)]"}

Every field is checked in `__post_init__`; a bad value raises ThreefoldError
naming the field (param "speculative_config.<field>") and the fix.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, fields
from typing import Any

from threefold.errors import ThreefoldError

METHODS = ("ngram", "draft_model", "medusa", "eagle")
MAX_SPECULATIVE_TOKENS = 16
"""Drafts per step beyond this never pay: acceptance decays geometrically with depth."""
MAX_TREE_TOKENS = 128
_PARAM = "speculative_config"


def _require(ok: bool, message: str, field: str) -> None:
    if not ok:
        raise ThreefoldError(message, param=f"{_PARAM}.{field}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    """Which proposer drafts: ngram (prompt lookup), draft_model, medusa or eagle."""
    num_speculative_tokens: int = 5
    """k: the most drafts per request per step (the chain length, or the tree depth)."""
    model: str | None = None
    """draft_model: a registry name, GGUF file or HF dir; medusa/eagle: the heads directory."""
    prompt_lookup_max: int | None = None
    """ngram: the longest suffix n-gram looked up in the context (default 4)."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest suffix n-gram that may match (default 1)."""
    speculative_token_tree: str | None = None
    """medusa: the static sparse tree as a list of paths of top-k ranks, e.g.
    "[(0,), (1,), (0, 0)]" (Medusa's mc_sim_7b_63 format); None: a chain."""
    tree_top_k: int = 1
    """eagle: children kept per expanded node (EAGLE-2's top_k); 1 = a chain."""
    tree_total_tokens: int | None = None
    """eagle: nodes kept after reranking (EAGLE-2's total_token); None = k * tree_top_k."""
    adaptive: bool = True
    """Choose each request's k per step from its acceptance history and the measured
    step cost (k = 0 allowed); False always drafts num_speculative_tokens."""
    acceptance_ema_weight: float = 0.3
    """Weight of the newest step in each request's acceptance-rate EMA, in (0, 1]."""
    disable_by_batch_size: int | None = None
    """Draft nothing while at least this many requests run (vLLM's option); None = never."""
    quantization: str | None = None
    """draft_model: "int8" streams the draft's weights as int8 with per-row scales in its
    decode steps (half of bf16's bytes, where drafting is bound by reading them); None: the
    target's dtype. Lossless either way: the target verifies every draft."""
    draft_vocab_size: int | None = None
    """Draft over only N tokens (FR-Spec / EAGLE-3's draft vocabulary), so the draft's LM head
    computes N rows instead of the whole vocabulary. medusa/eagle: the N the target wrote most
    often in the heads' training answers; None = the heads' own default. draft_model: the N most
    frequent in ShareGPT's train split (spec/draft_vocab.py); None = the whole vocabulary.
    0 = the whole vocabulary. Lossless either way (drafts are verified); a token outside it is
    just never drafted."""

    def __post_init__(self) -> None:
        _require(self.method in METHODS, f"unknown speculative method {self.method!r}; use one of "
                 f"{', '.join(METHODS)}.", "method")
        _require(_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                 f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got "
                 f"{self.num_speculative_tokens!r}.", "num_speculative_tokens")
        self._check_model()
        self._check_ngram()
        self._check_tree()
        _require(isinstance(self.adaptive, bool), f"adaptive must be true or false, got {self.adaptive!r}.",
                 "adaptive")
        _require(isinstance(self.acceptance_ema_weight, (int, float)) and 0 < self.acceptance_ema_weight <= 1,
                 f"acceptance_ema_weight must be in (0, 1], got {self.acceptance_ema_weight!r}.",
                 "acceptance_ema_weight")
        _require(self.disable_by_batch_size is None
                 or (_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
                 f"disable_by_batch_size must be a positive integer or null, got {self.disable_by_batch_size!r}.",
                 "disable_by_batch_size")
        if self.quantization is not None:
            _require(self.method == "draft_model", f"quantization sets a draft model's weight format; method "
                     f"{self.method!r} has no draft model.", "quantization")
            _require(self.quantization == "int8", f"quantization must be 'int8' or null, got "
                     f"{self.quantization!r}.", "quantization")
        if self.draft_vocab_size is not None:
            _require(self.method != "ngram", "draft_vocab_size slices a draft LM head; method 'ngram' drafts "
                     "from the context and has none.", "draft_vocab_size")
            _require(_is_int(self.draft_vocab_size) and self.draft_vocab_size >= 0,
                     f"draft_vocab_size must be a non-negative integer (0 = the whole vocabulary) or null, got "
                     f"{self.draft_vocab_size!r}.", "draft_vocab_size")

    @property
    def model_path(self) -> str:
        """`model`, for the methods whose validation requires it."""
        if self.model is None:
            raise ThreefoldError(f"method {self.method!r} needs model.", param="speculative_config.model")
        return self.model

    def _check_model(self) -> None:
        if self.method == "ngram":
            _require(self.model is None, f"method 'ngram' drafts from the context and takes no model; "
                     f"drop model={self.model!r} or use method 'draft_model'.", "model")
        else:
            _require(isinstance(self.model, str) and bool(self.model),
                     f"method {self.method!r} needs model: a draft model name or path"
                     f"{' (a heads directory)' if self.method in ('medusa', 'eagle') else ''}.", "model")

    def _check_ngram(self) -> None:
        given = {name: getattr(self, name) for name in ("prompt_lookup_max", "prompt_lookup_min")
                 if getattr(self, name) is not None}
        if self.method != "ngram":
            _require(not given, f"{', '.join(given)} apply only to method 'ngram', not {self.method!r}.",
                     next(iter(given), "method"))
            return
        for name, value in given.items():
            _require(_is_int(value) and 1 <= value <= 32, f"{name} must be an integer in [1, 32], got {value!r}.",
                     name)
        _require(self.lookup_min <= self.lookup_max, f"prompt_lookup_min ({self.lookup_min}) must not exceed "
                 f"prompt_lookup_max ({self.lookup_max}).", "prompt_lookup_min")

    def _check_tree(self) -> None:
        _require(_is_int(self.tree_top_k) and 1 <= self.tree_top_k <= 16,
                 f"tree_top_k must be an integer in [1, 16], got {self.tree_top_k!r}.", "tree_top_k")
        if self.tree_top_k > 1 or self.tree_total_tokens is not None:
            _require(self.method == "eagle", f"tree_top_k / tree_total_tokens shape EAGLE-2's dynamic tree; "
                     f"method {self.method!r} does not build one.", "tree_top_k")
        if self.tree_total_tokens is not None:
            _require(_is_int(self.tree_total_tokens) and 1 <= self.tree_total_tokens <= MAX_TREE_TOKENS,
                     f"tree_total_tokens must be an integer in [1, {MAX_TREE_TOKENS}], got "
                     f"{self.tree_total_tokens!r}.", "tree_total_tokens")
        if self.speculative_token_tree is not None:
            _require(self.method == "medusa", f"speculative_token_tree is Medusa's static tree; method "
                     f"{self.method!r} does not take one.", "speculative_token_tree")
            self.tree_paths()  # parses and validates

    # ---- derived values ----------------------------------------------------
    @property
    def lookup_max(self) -> int:
        return 4 if self.prompt_lookup_max is None else self.prompt_lookup_max

    @property
    def lookup_min(self) -> int:
        return 1 if self.prompt_lookup_min is None else self.prompt_lookup_min

    @property
    def uses_tree(self) -> bool:
        return self.tree_top_k > 1 or self.speculative_token_tree is not None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request may need beyond its tokens in one step: the most tree nodes, or k."""
        if self.speculative_token_tree is not None:
            return len(self.tree_paths())
        if self.tree_top_k > 1:
            return self.tree_total_tokens or self.num_speculative_tokens * self.tree_top_k
        return self.num_speculative_tokens

    def tree_tokens_by_depth(self) -> list[int] | None:
        """Trees: [d] = the nodes of this config's tree cut at depth d, d = 0..k (what a verify of
        depth d computes beyond the root; the adaptive controller's cost). None for chains."""
        k = self.num_speculative_tokens
        if self.speculative_token_tree is not None:
            paths = self.tree_paths()
            return [sum(1 for p in paths if len(p) <= d) for d in range(k + 1)]
        if self.tree_top_k > 1:  # EAGLE-2: top_k at depth 1, top_k^2 more per deeper level, reranked
            top_k = self.tree_top_k
            return [0] + [min(self.tree_total_tokens or d * top_k, top_k + (d - 1) * top_k * top_k)
                          for d in range(1, k + 1)]
        return None

    def tree_paths(self) -> list[tuple[int, ...]]:
        """Medusa's static tree: each node as the path of top-k ranks from the root."""
        if self.speculative_token_tree is None:
            return [(0,) * depth for depth in range(1, self.num_speculative_tokens + 1)]
        try:
            paths = [tuple(p) for p in ast.literal_eval(self.speculative_token_tree)]
        except (ValueError, SyntaxError, TypeError) as exc:
            raise ThreefoldError(f"speculative_token_tree must be a list of tuples of ranks such as "
                                 f"\"[(0,), (1,), (0, 0)]\": {exc}", param=f"{_PARAM}.speculative_token_tree") from exc
        return _checked_paths(paths, self.num_speculative_tokens)

    # ---- construction ------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(values, dict):
            raise ThreefoldError(f"speculative_config must be a JSON object, got {values!r}.", param=_PARAM)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ThreefoldError(f"unknown speculative_config key(s) {unknown}; known: {', '.join(sorted(known))}.",
                                 param=_PARAM)
        if "method" not in values:
            raise ThreefoldError(f"speculative_config needs a method: one of {', '.join(METHODS)}.",
                                 param=f"{_PARAM}.method")
        return cls(**values)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Accepts the CLI's JSON text, an LLM(...) dict, a config, or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ThreefoldError(f"speculative_config is not valid JSON ({exc}): {value!r}", param=_PARAM) from exc
        return cls.from_dict(value)  # type: ignore[arg-type]


def _checked_paths(paths: list[tuple[int, ...]], max_depth: int) -> list[tuple[int, ...]]:
    """Every node's parent must come before it; ranks are small non-negative ints."""
    seen: set[tuple[int, ...]] = {()}
    for path in paths:
        _require(0 < len(path) <= max_depth and all(_is_int(r) and 0 <= r < 64 for r in path),
                 f"each tree path must hold 1..num_speculative_tokens={max_depth} ranks in [0, 64), got {path!r}.",
                 "speculative_token_tree")
        _require(path[:-1] in seen, f"tree path {path!r} comes before its parent {path[:-1]!r}; list parents first.",
                 "speculative_token_tree")
        _require(path not in seen, f"tree path {path!r} is listed twice.", "speculative_token_tree")
        seen.add(path)
    _require(0 < len(paths) <= MAX_TREE_TOKENS, f"the tree must hold 1..{MAX_TREE_TOKENS} nodes, got {len(paths)}.",
             "speculative_token_tree")
    return paths
