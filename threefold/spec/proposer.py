"""The speculative proposer plug-in point: one base class and one registry.

A proposer turns each speculating request's context into drafts for the next
verify step. The engine asks once per step, for every request at once:

    drafts = proposer.propose([DraftRequest(rid, token_ids, num_drafts, hidden), ...])

Adding a proposer is one new file with a `Proposer` subclass and one line in
`PROPOSERS` below.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from threefold.errors import ThreefoldError
from threefold.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from torch import Tensor

ROOT = -1
"""Parent id of a tree node hanging off the root: the request's last real token."""


@dataclass
class DraftRequest:
    request_id: str
    token_ids: Sequence[int]
    """Prompt + output so far; the last one has no KV yet (it is this step's first query)."""
    num_drafts: int
    """Most drafts wanted this step (>= 1); a chain holds at most this many tokens, a
    tree at most this depth."""
    hidden_states: Tensor | None = None
    """Proposers with needs_hidden_states: the target's final hidden states
    [n, hidden] for positions hidden_start .. hidden_start + n - 1, those computed
    since the last call that are now part of the sequence (the last row predicted
    token_ids[-1]). None or empty where nothing new was computed (a prefix hit)."""
    hidden_start: int = 0


class Draft(NamedTuple):
    token_ids: list[int]
    """Drafted tokens in node order; empty = no speculation for this request this step."""
    parent_ids: list[int] | None = None
    """Trees: each node's parent index into token_ids (ROOT for the root's children), parents
    before children. None: a chain, each token following the one before."""

    @property
    def is_tree(self) -> bool:
        return self.parent_ids is not None


class Proposer(ABC):
    """Drafts tokens for the target to verify.

    Rules:
    - `propose` returns one Draft per DraftRequest, in order; a draft may be
      shorter than asked, or empty, but never longer.
    - Drafts never change the output: the rejection sampler keeps only what the
      target would have produced, so a proposer may guess freely.
    - Proposers that keep per-request state (draft KV, n-gram indexes) rebuild it
      from DraftRequest when it is missing: `remove` may have run (preemption),
      and a request may skip steps (k = 0).
    - Drafts are deterministic (one-hot q) unless `draft_probs` is overridden.
    """

    needs_hidden_states: ClassVar[bool] = False
    """True: the engine keeps the target's final hidden states for DraftRequest."""
    catch_up_seconds: float = 0.0
    """Seconds of the last `propose` spent bringing per-request state up to date rather than
    drafting (a draft model prefilling a new request's prompt): a one-time cost per request,
    which the adaptive controller's cost per draft token leaves out."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: SpeculativeConfig, target: Any = None) -> Proposer:
        """Build from the config; `target` is the target's LoadedModel (None for ngram)."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        ...

    def remove(self, request_id: str) -> None:  # noqa: B027 -- optional hook: stateless proposers keep nothing
        """The request finished or was preempted: drop whatever is kept for it."""


PROPOSERS: dict[str, str] = {
    "ngram": "threefold.spec.ngram:NgramProposer",
    "draft_model": "threefold.spec.draft_model:DraftModelProposer",
    "medusa": "threefold.spec.heads_proposer:MedusaProposer",
    "eagle": "threefold.spec.heads_proposer:EagleProposer",
}
"""method -> "module:Class", imported on first use (ngram needs no torch model)."""


def proposer_class(method: str) -> type[Proposer]:
    target = PROPOSERS.get(method)
    if target is None:
        raise ThreefoldError(f"speculative method {method!r} has no proposer here; available: "
                             f"{', '.join(PROPOSERS)}.", param="speculative_config.method")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def make_proposer(config: SpeculativeConfig, target: Any = None) -> Proposer:
    return proposer_class(config.method).from_config(config, target)
