"""The naive baseline of `bench cost`: transformers `generate` with static batching, in real time.

Run as its own process (so its peak RSS is its own):

    python -m threefold.bench.cost_hf SPEC.json OUT.json

It replays the workload's arrival schedule (the load generator's own seeded gaps and think
times) against a naive server: whenever it is idle it takes up to --hf-batch-size arrived
requests (oldest first), left-pads them into one batch and runs `generate` until the longest
is done; nothing joins a running batch. A stopping criterion stamps each decode step, so a
request's TTFT is its first step's time minus its arrival, its ITLs are the gaps between its
steps, and its E2E ends with its batch (a static batch holds every slot to the end).
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from threefold.bench.cost_workload import FIRST_TURNS, HUMANEVAL, LATER_TURNS
from threefold.bench.loadgen import arrival_gaps


@dataclass
class _Item:
    arrival: float
    order: int
    kind: str
    ids: list[int]
    max_tokens: int
    session: int | None = None
    turn: int | None = None
    task_id: str = ""
    messages: list[dict] = field(default_factory=list)


class _StepClock:
    """A StoppingCriteria that never stops and records when each generated token came out."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _initial_items(spec: dict, tokenizer) -> list[_Item]:
    rate, seed = spec["request_rate"], spec["seed"]
    items: list[_Item] = []
    streams = [(spec["sessions"], seed), (spec["first_turns"], seed + 1), (spec["humaneval"], seed + 2)]
    for stream, (entries, stream_seed) in enumerate(streams):
        arrival = 0.0
        for index, (entry, gap) in enumerate(zip(entries, arrival_gaps(len(entries), rate, stream_seed),
                                                 strict=True)):
            arrival += gap
            if stream == 0:
                messages = [{"role": "user", "content": entry["user_turns"][0]}]
                items.append(_Item(arrival, len(items), FIRST_TURNS, _chat_ids(tokenizer, messages),
                                   entry["max_tokens"][0], index, 0, messages=messages))
            elif stream == 1:
                messages = [{"role": "user", "content": entry["prompt"]}]
                items.append(_Item(arrival, len(items), FIRST_TURNS, _chat_ids(tokenizer, messages),
                                   entry["max_tokens"]))
            else:
                items.append(_Item(arrival, len(items), HUMANEVAL, tokenizer.encode(entry["prompt"]),
                                   entry["max_tokens"], task_id=entry["task_id"]))
    return items


def _generate(model, batch: list[_Item], pad: int) -> tuple[list[float], list[list[int]]]:
    width, steps = max(len(it.ids) for it in batch), max(it.max_tokens for it in batch)
    ids = torch.tensor([[pad] * (width - len(it.ids)) + it.ids for it in batch])
    mask = torch.tensor([[0] * (width - len(it.ids)) + [1] * len(it.ids) for it in batch])
    clock = _StepClock()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, pad_token_id=pad, stopping_criteria=[clock])
    return clock.times, out[:, width:].tolist()


def _row(item: _Item, times: list[float], end: float, text: str, t0: float) -> dict:
    own = [t - t0 for t in times[: item.max_tokens]]
    return {"class": item.kind, "start": item.arrival, "ttft": own[0] - item.arrival,
            "itl": [b - a for a, b in itertools.pairwise(own)], "e2e": end - item.arrival,
            "output_tokens": item.max_tokens, "prompt_tokens": len(item.ids), "text": text,
            "turn": item.turn, "session": item.session, "task_id": item.task_id, "order": item.order}


def _next_turn(spec: dict, item: _Item, reply: str, end: float, tokenizer) -> _Item | None:
    session = spec["sessions"][item.session]
    turn = (item.turn or 0) + 1
    if turn >= len(session["user_turns"]):
        return None
    think = spec["think_time"]
    rng = random.Random(spec["seed"] * 1_000_003 + (item.session or 0))  # the load generator's draw
    for _ in range(turn):
        wait = rng.expovariate(1.0 / think) if think > 0 else 0.0
    messages = [*item.messages, {"role": "assistant", "content": reply},
                {"role": "user", "content": session["user_turns"][turn]}]
    return _Item(end + wait, item.order, LATER_TURNS, _chat_ids(tokenizer, messages), session["max_tokens"][turn],
                 item.session, turn, messages=messages)


def run(spec: dict) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _generate(model, [_Item(0.0, 0, "", tokenizer.encode("Hello"), 2)], pad)  # warm-up
    queue, rows = _initial_items(spec, tokenizer), []
    t0 = time.perf_counter()
    while queue:
        now = time.perf_counter() - t0
        ready = sorted((it for it in queue if it.arrival <= now), key=lambda it: (it.arrival, it.order))
        if not ready:
            time.sleep(min(it.arrival for it in queue) - now)
            continue
        batch = ready[: spec["batch_size"]]
        chosen = {id(it) for it in batch}
        queue = [it for it in queue if id(it) not in chosen]
        times, new_ids = _generate(model, batch, pad)
        end = time.perf_counter() - t0
        for item, ids in zip(batch, new_ids, strict=True):
            text = str(tokenizer.decode(ids[: item.max_tokens], skip_special_tokens=True))  # one row: one string
            rows.append(_row(item, times, end, text, t0))
            if item.session is not None and (follow := _next_turn(spec, item, text, end, tokenizer)):
                queue.append(follow)
    duration = time.perf_counter() - t0
    return {"rows": rows, "duration_s": duration, "peak_rss_bytes": own_peak_rss()}


def own_peak_rss() -> int:
    """This process's resident-set high-water mark (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1], sys.argv[2]
    Path(out_path).write_text(json.dumps(run(json.loads(Path(spec_path).read_text()))))
