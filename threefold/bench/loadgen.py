"""The asyncio load generator: Poisson arrivals, a concurrency cap, sessions with think time.

Requests (or, for sessions, conversation starts) arrive as a Poisson process
at `request_rate` per second (all at once when it is inf); at most
`max_concurrency` requests are in flight, the rest wait their turn, exactly
as vLLM's benchmark does. A session sends turn i+1 only after turn i's reply
came back and an exponential think time passed; think time holds no
concurrency slot.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from threefold.bench.client import RequestResult, chat_body, completion_body, stream_request
from threefold.bench.datasets import SampleRequest, Session

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    """Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)."""
    model: str
    """The `model` field sent with each request."""
    endpoint: str = "completions"
    """`completions` or `chat`; sessions always use chat."""
    request_rate: float = math.inf
    """Mean arrivals per second (Poisson); inf sends everything at once."""
    max_concurrency: int | None = None
    """Most requests in flight; None is unbounded."""
    ignore_eos: bool = False
    temperature: float = 0.0
    think_time: float = 0.0
    """Mean seconds (exponential) between a session's reply and its next turn."""
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    logit_bias: dict[str, float] | None = None
    """Sent with every request; `--suppress-eos` bans the special tokens this way."""

    def url(self, endpoint: str) -> str:
        root = self.base_url.rstrip("/")
        root = root[:-3] if root.endswith("/v1") else root
        return root + ENDPOINTS[endpoint]


def arrival_gaps(num: int, rate: float, seed: int) -> Iterator[float]:
    """Seconds to wait before each arrival: exponential with mean 1/rate (0 for inf)."""
    rng = random.Random(seed)
    for _ in range(num):
        yield 0.0 if math.isinf(rate) else rng.expovariate(rate)


def make_client(cfg: LoadConfig) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must never sit between us and the server.
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


class _Runner:
    """Shared state of one run: the client, the concurrency cap, the clock and the bar."""

    def __init__(self, cfg: LoadConfig, client: httpx.AsyncClient, total: int) -> None:
        self.cfg = cfg
        self.client = client
        self.slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.t_origin = time.perf_counter()
        self.bar = tqdm(total=total, disable=not cfg.progress, unit="req", dynamic_ncols=True)

    async def send(self, endpoint: str, body: dict, result: RequestResult) -> RequestResult:
        url = self.cfg.url(endpoint)
        if self.slots is None:
            await stream_request(self.client, url, body, endpoint == "chat", result, self.t_origin)
        else:
            async with self.slots:
                await stream_request(self.client, url, body, endpoint == "chat", result, self.t_origin)
        self.bar.update(1)
        return result

    def single_body(self, request: SampleRequest) -> dict:
        cfg = self.cfg
        if cfg.endpoint == "chat":
            if not isinstance(request.prompt, str):
                raise ValueError("the chat endpoint needs text prompts; use --random-mode words")
            messages = [{"role": "user", "content": request.prompt}]
            return chat_body(cfg.model, messages, request.max_tokens, cfg.ignore_eos, cfg.temperature,
                             cfg.logit_bias)
        return completion_body(cfg.model, request.prompt, request.max_tokens, cfg.ignore_eos, cfg.temperature,
                               cfg.logit_bias)

    async def session(self, index: int, session: Session) -> tuple[list[RequestResult], int]:
        """Play one conversation; a failed turn ends it (its later turns are skipped)."""
        cfg, results = self.cfg, []
        rng = random.Random(cfg.seed * 1_000_003 + index)
        messages: list[dict] = [{"role": "system", "content": session.system}] if session.system else []
        for turn, user in enumerate(session.user_turns):
            messages.append({"role": "user", "content": user})
            body = chat_body(cfg.model, list(messages), session.max_tokens[turn], cfg.ignore_eos, cfg.temperature,
                             cfg.logit_bias)
            prompt_len = session.system_len + sum(session.user_lens[: turn + 1]) + sum(session.max_tokens[:turn])
            result = RequestResult(prompt_len=prompt_len, turn=turn, session_id=session.session_id)
            results.append(await self.send("chat", body, result))
            if not result.ok:
                skipped = len(session.user_turns) - turn - 1
                self.bar.update(skipped)
                return results, skipped
            messages.append({"role": "assistant", "content": result.text})  # the server's reply, not the dataset's
            if cfg.think_time > 0 and turn + 1 < len(session.user_turns):
                await asyncio.sleep(rng.expovariate(1.0 / cfg.think_time))
        return results, 0


async def _spawn_with_arrivals(num: int, cfg: LoadConfig, start) -> list[asyncio.Task]:
    """Start task i at the i-th arrival time; sleeping to absolute times keeps
    oversleeping on a busy machine from accumulating into a lower rate."""
    tasks, due, t0 = [], 0.0, time.perf_counter()
    for i, gap in enumerate(arrival_gaps(num, cfg.request_rate, cfg.seed)):
        due += gap
        delay = due - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(start(i)))
    return tasks


async def run_requests(requests: list[SampleRequest], cfg: LoadConfig) -> tuple[list[RequestResult], float]:
    """Send single-turn requests; returns results in request order and the wall-clock duration."""
    async with make_client(cfg) as client:
        runner = _Runner(cfg, client, len(requests))

        def start(i: int):
            result = RequestResult(prompt_len=requests[i].prompt_len)
            return runner.send(cfg.endpoint, runner.single_body(requests[i]), result)

        tasks = await _spawn_with_arrivals(len(requests), cfg, start)
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - runner.t_origin
        runner.bar.close()
    return results, duration


async def run_sessions(sessions: list[Session], cfg: LoadConfig) -> tuple[list[RequestResult], float, int]:
    """Play conversations; returns all turns' results, the duration and the number of skipped turns."""
    async with make_client(cfg) as client:
        runner = _Runner(cfg, client, sum(len(s.user_turns) for s in sessions))
        tasks = await _spawn_with_arrivals(len(sessions), cfg, lambda i: runner.session(i, sessions[i]))
        played = await asyncio.gather(*tasks)
        duration = time.perf_counter() - runner.t_origin
        runner.bar.close()
    results = [r for session_results, _ in played for r in session_results]
    return results, duration, sum(skipped for _, skipped in played)


async def fetch_model_name(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model a server lists at /v1/models (what to send when --model is not given)."""
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        response = await client.get(root + "/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
