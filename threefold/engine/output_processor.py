"""Per-request text state: detokenize, apply stop strings, build RequestOutputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from threefold.core.outputs import EngineCoreOutput, TokenLogprobs
from threefold.engine.detokenizer import IncrementalDetokenizer
from threefold.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from threefold.sample.params import SamplingParams


@dataclass
class CompletionState:
    index: int
    child_id: str
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    """DELTA outputs: tokens (and logprobs) already handed out."""
    num_sent_chars: int = 0
    """DELTA outputs: characters of text already handed out."""

    def output(self, kind: RequestOutputKind) -> CompletionOutput:
        finished = self.finish_reason is not None
        if kind is not RequestOutputKind.DELTA:
            return CompletionOutput(self.index, self.detokenizer.output_text(finished), list(self.token_ids),
                                    self.cumulative_logprob, list(self.logprobs) if self.logprobs is not None
                                    else None, self.finish_reason, self.stop_reason)
        # Slices of what is new: O(new tokens), however long the completion is.
        end = self.detokenizer.visible_len(finished)
        text = self.detokenizer.text[self.num_sent_chars : end]
        token_ids = self.token_ids[self.num_sent_tokens :]
        logprobs = self.logprobs[self.num_sent_tokens :] if self.logprobs is not None else None
        self.num_sent_chars = max(self.num_sent_chars, end)
        self.num_sent_tokens = len(self.token_ids)
        return CompletionOutput(self.index, text, token_ids, self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)


@dataclass
class RequestState:
    """One user request (its `n` completions are child requests in the core)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    metrics: RequestMetrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def to_output(self) -> RequestOutput | None:
        """This step's output, shaped by `output_kind`; None when there is nothing to hand out."""
        finished = self.finished
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_logprobs is not None
        outputs = [c.output(self.output_kind) for c in self.completions]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_logprobs,
                             outputs, finished, self.num_cached_tokens, self.metrics, self.error,
                             num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
                             cached_tokens_by_tier=self.cached_tokens_by_tier)


class OutputProcessor:
    """Applies core outputs to request states. Returns which children stopped on text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend

    def new_state(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  params: SamplingParams, child_ids: list[str], arrival_time: float,
                  output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> RequestState:
        completions = [CompletionState(i, child_id, IncrementalDetokenizer(self.backend, prompt_token_ids, params),
                                       logprobs=[] if params.logprobs is not None else None,
                                       cumulative_logprob=0.0 if params.logprobs is not None else None)
                       for i, child_id in enumerate(child_ids)]
        return RequestState(request_id, prompt, prompt_token_ids, params, completions,
                            RequestMetrics(arrival_time), output_kind)

    def apply(self, state: RequestState, completion: CompletionState, out: EngineCoreOutput) -> bool:
        """Update one completion; True if a stop string finished it (the core must be told)."""
        now = time.time()
        metrics = state.metrics
        if out.error is not None:
            state.error = out.error
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = [None if p is None else self._position(p) for p in out.prompt_logprobs]
        if completion.index == 0:
            state.num_cached_tokens = out.num_cached_tokens
            state.cached_tokens_by_tier = out.cached_tokens_by_tier
        state.num_draft_tokens += out.num_draft_tokens
        state.num_accepted_tokens += out.num_accepted_tokens
        if out.new_token_ids:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
        completion.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            # The core sends logprobs only to requests that asked; their state starts with [] and 0.0.
            assert completion.logprobs is not None and completion.cumulative_logprob is not None
            for entry in out.new_logprobs:
                completion.logprobs.append(self._position(entry))
                completion.cumulative_logprob += entry.logprobs[0]
        stop = completion.detokenizer.update(out.new_token_ids)
        stopped_on_text = stop is not None and out.finish_reason is None
        if stop is not None:
            completion.finish_reason, completion.stop_reason = "stop", stop
        elif out.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        if state.finished:
            metrics.finished_time = now
        return stopped_on_text

    def _position(self, entry: TokenLogprobs) -> PositionLogprobs:
        texts = self.backend.decode_batch([[t] for t in entry.token_ids], skip_special_tokens=False)
        result = {entry.token_ids[0]: Logprob(entry.logprobs[0], entry.rank, texts[0])}
        top_k = zip(entry.token_ids[1:], entry.logprobs[1:], texts[1:], strict=True)
        for rank, (token_id, logprob, text) in enumerate(top_k, 1):
            result.setdefault(token_id, Logprob(logprob, rank, text))
        return result
