"""Workloads for the simulator: multi-turn ShareGPT sessions and a Mooncake-like trace.

A trace is a list of sessions; a session is a list of turns, each turn's
prompt holding the whole conversation so far (so turn t+1 shares turn t's
prompt and answer as its prefix). Token ids are synthetic (seeded random ids),
only their lengths and their sharing matter; block hashes are the router's
own chained hashes (threefold/router/radix.py), so router and replicas agree.

Arrivals (`arrivals`): sessions start as a Poisson process of rate
`rate / mean_turns` (so requests arrive at about `rate` per second); a later
turn is sent a think time (exponential, mean `think_s`) after the previous
turn's answer finished, as a user would.

`sessions`: ShareGPT V3 conversations (test split) turn by turn; lengths are
estimated at 4 characters per token (no tokenizer in the loop), each turn's
answer length capped at `max_output`, a conversation cut where it would pass
`max_context`. Conversations are reused cyclically, with fresh ids, when a
trace needs more sessions than the split has.

`mooncake`: single-turn requests with shared prefixes, generated from the
Mooncake trace statistics (Qin et al., "Mooncake", FAST'25, arXiv 2407.00079,
and its released 1-hour trace: 23,608 requests, mean input 7,590 and mean
output 182 tokens, prefixes shared in 512-token blocks). Scaled by 1/8 for a
135M model on CPU (mean input ~950, output ~23 tokens). Assumed, since the
paper gives no distribution: input lengths lognormal (sigma 0.8); each request
draws one of `num_prefixes` shared prefixes by Zipf popularity (s = 1.1) that
covers ~60% of its input (a system prompt / document / tool spec), the rest
unique. Each is documented in BENCHMARKS.md next to the numbers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from threefold.errors import ThreefoldError
from threefold.router.radix import block_hashes, prefix_key

TRACES = ("sessions", "mooncake")
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Turn:
    prompt_len: int
    output_len: int
    prompt_hashes: tuple[int, ...]
    cache_hashes: tuple[int, ...]
    key: int


@dataclass(frozen=True)
class Trace:
    name: str
    sessions: list[list[Turn]]
    think_s: float = 5.0
    arrival_times: list[list[float]] | None = None
    """Each turn's arrival time (a replayed run's): sent open loop, no think times. None: `arrivals`."""

    @property
    def num_requests(self) -> int:
        return sum(len(s) for s in self.sessions)

    @property
    def mean_turns(self) -> float:
        return self.num_requests / len(self.sessions)

    def arrivals(self, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Session start times at `rate` requests/s, and each turn's think time (same seed, same trace)."""
        if rate <= 0:
            raise ThreefoldError(f"request rate must be > 0, got {rate}", param="rates")
        rng = np.random.default_rng(seed)
        starts = np.cumsum(rng.exponential(self.mean_turns / rate, len(self.sessions)))
        thinks = rng.exponential(self.think_s, self.num_requests)
        return starts, thinks


def _turn(stream: list[int], hashes: tuple[int, ...], prompt_len: int, output_len: int,
          block_size: int, key_tokens: int) -> Turn:
    return Turn(prompt_len, output_len, hashes[:prompt_len // block_size],
                hashes[:(prompt_len + output_len) // block_size],
                prefix_key(stream[:prompt_len], block_size, key_tokens))


def _conversation_lengths(num: int, seed: int) -> list[list[tuple[int, int]]]:
    from threefold.bench.sharegpt import dialogue, open_sharegpt

    out: list[list[tuple[int, int]]] = []
    for record in open_sharegpt().iter_records("test", seed):
        pairs = [(max(1, len(u) // CHARS_PER_TOKEN), max(1, len(a) // CHARS_PER_TOKEN)) for u, a in dialogue(record)]
        if pairs:
            out.append(pairs)
        if len(out) >= num:
            break
    return out


def sessions_trace(num_sessions: int, seed: int = 0, block_size: int = 16, key_tokens: int = 64,
                   max_output: int = 128, max_context: int = 4096, think_s: float = 5.0,
                   conversations: list[list[tuple[int, int]]] | None = None) -> Trace:
    """ShareGPT multi-turn sessions (or the given (user, answer) length lists, for tests)."""
    convs = conversations if conversations is not None else _conversation_lengths(min(num_sessions, 4000), seed)
    rng = np.random.default_rng(seed)
    sessions: list[list[Turn]] = []
    for pairs in itertools.islice(itertools.cycle(convs), num_sessions):
        lengths, total = [], 0
        for user, full_answer in pairs:
            answer = min(full_answer, max_output)
            if total + user + answer > max_context:
                break
            lengths.append((total + user, answer))
            total += user + answer
        if not lengths:
            lengths = [(min(pairs[0][0], max_context - max_output), min(pairs[0][1], max_output))]
            total = sum(lengths[0])
        stream = rng.integers(0, 2**31 - 1, total).tolist()
        hashes = block_hashes(stream, block_size)
        sessions.append([_turn(stream, hashes, p, o, block_size, key_tokens) for p, o in lengths])
    return Trace("sessions", sessions, think_s)


def mooncake_trace(num_requests: int, seed: int = 0, block_size: int = 16, key_tokens: int = 64,
                   scale: float = 1 / 8, num_prefixes: int = 200, zipf_s: float = 1.1,
                   shared_fraction: float = 0.6) -> Trace:
    """Single-turn requests sharing Zipf-popular prefixes, Mooncake's length statistics scaled."""
    rng = np.random.default_rng(seed)
    mean_in, mean_out, sigma = 7590 * scale, 182 * scale, 0.8
    inputs = rng.lognormal(np.log(mean_in) - sigma**2 / 2, sigma, num_requests).astype(int).clip(block_size, 4096)
    outputs = rng.lognormal(np.log(mean_out) - sigma**2 / 2, sigma, num_requests).astype(int).clip(1, 512)
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** zipf_s
    choice = rng.choice(num_prefixes, num_requests, p=weights / weights.sum())
    prefix_pool = rng.integers(0, 2**31 - 1, (num_prefixes, 4096)).tolist()
    sessions = []
    for n_in, n_out, which in zip(inputs.tolist(), outputs.tolist(), choice.tolist(), strict=True):
        shared = int(n_in * shared_fraction) // block_size * block_size
        stream = prefix_pool[which][:shared] + rng.integers(0, 2**31 - 1, n_in + n_out - shared).tolist()
        hashes = block_hashes(stream, block_size)
        sessions.append([_turn(stream, hashes, n_in, n_out, block_size, key_tokens)])
    return Trace("mooncake", sessions, 0.0)


def make_trace(name: str, num_requests: int, seed: int, block_size: int, key_tokens: int) -> Trace:
    if name == "sessions":
        probe = sessions_trace(64, seed, block_size, key_tokens)  # turns per session, to size the trace
        return sessions_trace(max(1, round(num_requests / probe.mean_turns)), seed, block_size, key_tokens)
    if name == "mooncake":
        return mooncake_trace(num_requests, seed, block_size, key_tokens)
    raise ThreefoldError(f"unknown trace {name!r}; choose one of {', '.join(TRACES)}", param="trace")
