"""The one workload of `threefold bench cost`, and how it is sent to a server.

Three kinds of traffic, sent together and timed as one run:

    sessions     ShareGPT multi-turn conversations (chat): turn i+1 resends the history with
                 the server's own replies after an exponential think time
    first turns  ShareGPT first user turns (chat), from a different draw than the sessions
    humaneval    HumanEval code prompts (completions); their outputs are executed for pass@1

Every request generates exactly its max_tokens (ignore_eos), greedy, so every rung does the
same work. Arrivals: each stream is a Poisson process at --request-rate (all at t=0 when inf),
seeded, so every rung sees the same schedule; the transformers baseline replays it too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass

from threefold.bench.client import RequestResult
from threefold.bench.datasets import (
    LengthLimits,
    SampleRequest,
    Session,
    load_humaneval,
    load_sharegpt,
    load_sharegpt_sessions,
)
from threefold.bench.loadgen import LoadConfig, run_requests, run_sessions

LATER_TURNS, FIRST_TURNS, HUMANEVAL = "later turns", "first turns", "humaneval"
CLASSES = (LATER_TURNS, FIRST_TURNS, HUMANEVAL)
"""Traffic classes the per-class numbers are split by (a session's turn 0 is a first turn)."""


@dataclass(frozen=True)
class Workload:
    sessions: list[Session]
    first_turns: list[SampleRequest]
    humaneval: list[SampleRequest]
    """source_id is the HumanEval task_id."""

    def stats(self) -> dict:
        turns = sum(len(s.user_turns) for s in self.sessions)
        return {"sessions": len(self.sessions), "session_turns": turns, "first_turns": len(self.first_turns),
                "humaneval": len(self.humaneval), "requests": turns + len(self.first_turns) + len(self.humaneval),
                "output_tokens": (sum(sum(s.max_tokens) for s in self.sessions)
                                  + sum(r.max_tokens for r in self.first_turns + self.humaneval))}


@dataclass(frozen=True)
class Traffic:
    request_rate: float = math.inf
    """Poisson arrivals per second, per stream (inf: all at once)."""
    think_time: float = 0.5
    """Mean seconds between a session's reply and its next turn."""
    seed: int = 0
    timeout_s: float = 600.0


def build_workload(tokenizer, num_sessions: int, num_first: int, num_humaneval: int, max_turns: int,
                   limits: LengthLimits, seed: int = 0) -> Workload:
    sessions = (load_sharegpt_sessions(num_sessions, tokenizer, limits, seed, min_turns=2, max_turns=max_turns)
                if num_sessions else [])
    # Another seed than the sessions': first turns are other conversations, not the sessions' openings.
    first = load_sharegpt(num_first, tokenizer, limits, seed + 1) if num_first else []
    code = load_humaneval(num_humaneval, tokenizer, limits, seed) if num_humaneval else []
    return Workload(sessions, first, code)


@dataclass
class Played:
    """One rung's run: every request's result with its traffic class, and the wall time."""

    results: list[RequestResult]
    classes: list[str]
    duration_s: float
    skipped_turns: int = 0
    humaneval_texts: dict[str, str] = dataclasses.field(default_factory=dict)
    """task_id -> completion text (failed requests: absent)."""


async def _play(base_url: str, model: str, workload: Workload, traffic: Traffic) -> Played:
    chat = LoadConfig(base_url, model, "chat", traffic.request_rate, None, ignore_eos=True, temperature=0.0,
                      think_time=traffic.think_time, seed=traffic.seed, timeout_s=traffic.timeout_s, progress=False)
    code = dataclasses.replace(chat, endpoint="completions", seed=traffic.seed + 2)
    start = time.perf_counter()
    (sessions, _, skipped), (first, _), (humaneval, _) = await asyncio.gather(
        run_sessions(workload.sessions, chat),
        run_requests(workload.first_turns, dataclasses.replace(chat, seed=traffic.seed + 1)),
        run_requests(workload.humaneval, code))
    duration = time.perf_counter() - start
    classes = ([LATER_TURNS if r.turn else FIRST_TURNS for r in sessions]
               + [FIRST_TURNS] * len(first) + [HUMANEVAL] * len(humaneval))
    texts = {req.source_id: res.text for req, res in zip(workload.humaneval, humaneval, strict=True) if res.ok}
    return Played(sessions + first + humaneval, classes, duration, skipped, texts)


def play(base_url: str, model: str, workload: Workload, traffic: Traffic) -> Played:
    """Send the whole workload to an OpenAI-compatible server (or router) and time it."""
    return asyncio.run(_play(base_url, model, workload, traffic))


def single_turn_texts(played: Played) -> list[str | None]:
    """Outputs of the first turns and HumanEval requests in workload order (None: failed), for
    comparing rungs' greedy outputs; later session turns depend on earlier replies, so not those."""
    return [r.text if r.ok else None for r in played.results if r.turn is None]
