"""Prompt lookup (n-gram) drafting (apoorvumang/prompt-lookup-decoding; vLLM's "ngram").

The context's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
are looked up earlier in the prompt and the output; the tokens that followed
the match are the drafts. Among matches of the longest n the most recent wins
(generated text repeats its own recent structure more than the prompt's start).

One lookup is O(lookback * n_max) numpy work, vectorised over every candidate
position at once: for each position j it counts how many tokens ending at j
agree with the context's suffix, a single pass per suffix offset.

    context  a b c d x y a b c
    offset 0     ^ c==c   at j=2 ... and so on; a run of n_max agreeing offsets
    drafts   the tokens after the best j:  d x y ...
"""

from __future__ import annotations

import numpy as np

from threefold.spec.config import SpeculativeConfig
from threefold.spec.proposer import Draft, DraftRequest, Proposer

MAX_LOOKBACK = 8192
"""Only the last MAX_LOOKBACK tokens are searched: one step stays O(lookback)."""


def ngram_lookup(context: np.ndarray, n_min: int, n_max: int, k: int, lookback: int = MAX_LOOKBACK) -> np.ndarray:
    """Up to k drafts for the 1-D int context; an empty array when no n-gram of at least
    n_min tokens recurs."""
    window = context[-lookback:]
    length = len(window)
    if length < n_min + 1 or k < 1:
        return window[:0]
    ends = np.arange(length - 1)  # a match must end before the suffix's last token to have a follower
    run = np.zeros(length - 1, dtype=np.int64)
    alive = np.ones(length - 1, dtype=bool)
    for offset in range(min(n_max, length - 1)):
        back = ends - offset
        alive &= back >= 0
        alive &= window[np.maximum(back, 0)] == window[length - 1 - offset]
        run += alive
    best = int(run.max())
    if best < n_min:
        return window[:0]
    end = (length - 2) - int(np.argmax(run[::-1] == best))  # the most recent of the longest matches
    return window[end + 1 : end + 1 + k]


class _Context:
    """A request's tokens as a growing numpy buffer: appending is amortised O(1)."""

    def __init__(self) -> None:
        self.buffer = np.empty(64, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids) -> np.ndarray:
        """Bring the buffer up to token_ids (the engine only appends; a shorter or
        different list, e.g. after preemption, is copied afresh)."""
        num = len(token_ids)
        if num < self.length or (self.length and self.buffer[self.length - 1] != token_ids[self.length - 1]):
            self.length = 0
        if num > len(self.buffer):
            grown = np.empty(max(num, 2 * len(self.buffer)), dtype=np.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        self.buffer[self.length : num] = token_ids[self.length : num]
        self.length = num
        return self.buffer[:num]


class NgramProposer(Proposer):
    def __init__(self, n_min: int, n_max: int, lookback: int = MAX_LOOKBACK) -> None:
        self.n_min, self.n_max, self.lookback = n_min, n_max, lookback
        self.contexts: dict[str, _Context] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target=None) -> NgramProposer:
        return cls(config.lookup_min, config.lookup_max)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = []
        for request in requests:
            context = self.contexts.setdefault(request.request_id, _Context()).sync(request.token_ids)
            found = ngram_lookup(context, self.n_min, self.n_max, request.num_drafts, self.lookback)
            drafts.append(Draft(found.tolist()))
        return drafts

    def remove(self, request_id: str) -> None:
        self.contexts.pop(request_id, None)
