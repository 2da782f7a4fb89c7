"""Logprob tensors for sampled tokens (and, via the runner, prompt tokens)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LogprobsTensors(NamedTuple):
    """Per row: the given token first, then the top-K tokens, most likely first."""

    token_ids: Tensor
    """[N, K+1] long: column 0 = the sampled (or prompt) token, then the top-K ids."""
    logprobs: Tensor
    """[N, K+1] float32, matching token_ids."""
    ranks: Tensor
    """[N] long: rank of the column-0 token, 1 = most likely (ties count against it, as in vLLM)."""


def compute_logprobs_tensors(logprobs: Tensor, num_top: int, token_ids: Tensor) -> LogprobsTensors:
    """`logprobs` [N, V] already log_softmax'ed; `token_ids` [N] the tokens to report."""
    token_ids = token_ids.long()[:, None]  # [N, 1]
    token_logprobs = logprobs.gather(-1, token_ids)  # [N, 1]
    ranks = (logprobs >= token_logprobs).sum(-1)
    top = logprobs.topk(num_top, -1)  # [N, num_top] each; empty when num_top == 0
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top.indices], dim=1),
        logprobs=torch.cat([token_logprobs, top.values], dim=1),
        ranks=ranks,
    )

