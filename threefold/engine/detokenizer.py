"""Incremental detokenization and stop strings for one completion."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from threefold.sample.params import SamplingParams

# Prompt tokens fed to the stream as context, so the first output token
# decodes as it would mid-text (leading spaces, merged bytes).
_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive and finds stop strings.

    While a request runs, text that could still be the start of a stop
    string is held back, so a streamed delta never has to be taken back.
    """

    def __init__(self, backend, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.backend = backend
        self.params = params
        self.stream = DecodeStream(ids=prompt_token_ids[-_CONTEXT_TOKENS:],
                                   skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self.num_tokens = 0
        stops = params.stop_strings
        self.max_stop_len = max((len(s) for s in stops), default=0)
        self.holdback = 0 if params.include_stop_str_in_output else max(0, self.max_stop_len - 1)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode new tokens; returns the stop string that matched (text is then final)."""
        for token_id in new_token_ids:
            self.num_tokens += 1
            chunk = self.stream.step(self.backend, token_id)
            if not chunk:
                continue
            previous = len(self.text)
            self.text += chunk
            if self.max_stop_len and self.num_tokens >= self.params.min_tokens:
                stop = self._find_stop(previous)
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, previous_len: int) -> str | None:
        search_from = max(0, previous_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop_strings:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop)] if self.params.include_stop_str_in_output else self.text[:index]
        return stop

    def output_text(self, finished: bool) -> str:
        return self.text[: self.visible_len(finished)] if self.holdback and not finished else self.text

    def visible_len(self, finished: bool) -> int:
        """How much of `text` may be shown: all of it once finished, else all but the holdback."""
        if finished or not self.holdback:
            return len(self.text)
        return max(0, len(self.text) - self.holdback)
