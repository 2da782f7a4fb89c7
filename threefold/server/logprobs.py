"""Engine logprobs (dict[token_id, Logprob] per position) in the two OpenAI response formats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from threefold.engine.outputs import Logprob, PositionLogprobs

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp here


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def token_text(tokenizer: Any, token_id: int, logprob: Logprob | None = None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _ranked(position: PositionLogprobs) -> list[tuple[int, Logprob]]:
    """Entries best first (the chosen token may sit outside the top-k, with a larger rank)."""
    return sorted(position.items(), key=lambda item: (item[1].rank if item[1].rank is not None else 1 << 30,
                                                      -item[1].logprob))


class LegacyLogprobs:
    """The /v1/completions logprobs object, built a slice at a time.

    `text_offset` runs across calls (prompt then completion, or chunk after
    chunk), so streamed slices carry the same offsets a whole response would.
    """

    def __init__(self, tokenizer: Any, start_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = start_offset

    def slice(self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None] | None) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, token_id in enumerate(token_ids):
            position = positions[i] if positions is not None and i < len(positions) else None
            chosen = position.get(token_id) if position else None
            text = token_text(self.tokenizer, token_id, chosen)
            out["tokens"].append(text)
            out["token_logprobs"].append(_clamp(chosen.logprob) if chosen else None)
            out["top_logprobs"].append(
                {token_text(self.tokenizer, tid, lp): _clamp(lp.logprob) for tid, lp in _ranked(position)}
                if position else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def concat_legacy(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int],
                  positions: Sequence[PositionLogprobs | None] | None, top_logprobs: int) -> dict:
    """The /v1/chat/completions logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for i, token_id in enumerate(token_ids):
        position = positions[i] if positions is not None and i < len(positions) else None
        chosen = position.get(token_id) if position else None
        text = token_text(tokenizer, token_id, chosen)
        top = [_chat_entry(token_text(tokenizer, tid, lp), lp.logprob)
               for tid, lp in _ranked(position)[:top_logprobs]] if position else []
        entry = _chat_entry(text, chosen.logprob if chosen else _MIN_LOGPROB)
        entry["top_logprobs"] = top
        content.append(entry)
    return {"content": content}


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}
