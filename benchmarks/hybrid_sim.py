"""The hybrid scheduler on a virtual clock: online p99s and offline tok/s for many rules in seconds.

    tfrun .venv/bin/python benchmarks/hybrid_sim.py --measure-grid results/step_grid.json   # ~2 min, once
    tfrun .venv/bin/python benchmarks/hybrid_sim.py --grid results/step_grid.json --seeds 10 \\
        --schedules "hybrid,s=0:0,s=0.5:0.5,s=1 ungated:1:0"

The real `core.Scheduler` plans every step; only the forward is replaced: its time comes from
a grid measured on this machine (engine steps of D running decodes plus one fresh P-token
prompt chunk, bilinear between points, +1.5 ms for each further chunk, 5% Gaussian noise), and
the clock jumps by it. The predictor is the engine's: a LinearStepModel calibrated from the
grid's 1, 64 and 256-token prompts and refitted from every simulated step. Workloads and
arrivals as in benchmarks/hybrid.py: ShareGPT online requests at a share of --capacity
(Poisson), --offline batch lines (half HumanEval, half ShareGPT-train) queued at t=0.

What it leaves out: sampling and host work beyond the grid, the machine's own drift, and
detokenization; so it ranks rules and shows which way a knob moves the p99s, and the idle
benchmark says by how much. Latencies are pooled over --seeds (different arrivals each).
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
from dataclasses import dataclass, field

from threefold.bench.datasets import LengthLimits, SampleRequest, load_humaneval, load_sharegpt
from threefold.bench.tokenizer import load_tokenizer
from threefold.config import SchedulerConfig
from threefold.core import hybrid
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.outputs import ModelRunnerOutput
from threefold.core.request import Request
from threefold.core.scheduler import Scheduler
from threefold.core.step_cost import LinearStepModel
from threefold.sample.params import SamplingParams

DECODES = (0, 1, 2, 4, 8, 16, 32, 64)
PROMPT_TOKENS = (0, 1, 16, 64, 128, 256, 512, 900)
CHUNK_SECONDS = 0.0015
"""Each prompt chunk past the first: its own attention call per layer (measured 1-2 ms, hybrid3)."""
KV_BLOCKS = 1456
"""512 MiB of bf16 KV for SmolLM2-135M (23,040 bytes a token) in 16-token blocks, as benchmarks/hybrid.py."""


class StepTimes:
    """Seconds of a step with `decodes` one-token rows and `prompt` tokens in `chunks` prompt chunks."""

    def __init__(self, points: list[list[float]]) -> None:
        self.seconds = {(int(d), int(p)): s for d, p, s in points}

    def __call__(self, decodes: int, prompt: int, chunks: int) -> float:
        if decodes == 0 and prompt == 0:
            return 0.0
        i, a = _between(DECODES, decodes)
        j, b = _between(PROMPT_TOKENS, prompt)
        at = self.seconds
        low = (1 - a) * at[DECODES[i], PROMPT_TOKENS[j]] + a * at[DECODES[i + 1], PROMPT_TOKENS[j]]
        high = (1 - a) * at[DECODES[i], PROMPT_TOKENS[j + 1]] + a * at[DECODES[i + 1], PROMPT_TOKENS[j + 1]]
        return (1 - b) * low + b * high + max(0, chunks - 1) * CHUNK_SECONDS


def _between(points: tuple[int, ...], x: int) -> tuple[int, float]:
    """Index of the grid interval holding x (the last one past the end) and x's share along it."""
    i = max(0, min(len(points) - 2, bisect.bisect_right(points, x) - 1))
    return i, (x - points[i]) / (points[i + 1] - points[i])


def measure_grid(path: str) -> None:
    """Time real engine steps over DECODES x PROMPT_TOKENS (best of 5 decode steps, of 2 prompt steps)."""
    import time

    from threefold.engine.llm_engine import EngineArgs, LLMEngine
    from threefold.model.loader import load_model
    loaded = load_model("smollm2-135m")
    rng = random.Random(0)
    points = []
    for decodes in DECODES:
        engine = LLMEngine(loaded, EngineArgs(model="smollm2-135m", kv_cache_memory=512 << 20, max_model_len=1024))
        for i in range(decodes):
            tokens = [rng.randrange(100, 40000) for _ in range(150)]
            engine.add_request(f"d{i}", tokens, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        for _ in range(3):
            engine.step()  # the prompts, then the first decodes
        for prompt in PROMPT_TOKENS:
            timings = []
            for repeat in range(5 if prompt == 0 else 2):
                rid = f"p{prompt}-{repeat}"
                if prompt:
                    tokens = [rng.randrange(100, 40000) for _ in range(max(prompt, 2))]
                    engine.add_request(rid, tokens, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
                start = time.perf_counter()
                engine.step()
                timings.append(time.perf_counter() - start)
                engine.abort_request([rid])
            points.append([decodes, prompt, min(timings)])
            print(f"{decodes} decodes + {prompt}-token prompt: {min(timings) * 1e3:.1f} ms", flush=True)
        engine.close()
    with open(path, "w") as f:
        json.dump(points, f)


@dataclass
class Cell:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    offline_tok_s: list[float] = field(default_factory=list)
    online_seqs: list[float] = field(default_factory=list)
    idle_steps: int = 0


def simulate(times: StepTimes, config: SchedulerConfig, arrivals: list[float], online: list[list[int]],
             online_max: list[int], offline: list[tuple[list[int], int]], duration: float, seed: int,
             cell: Cell) -> None:
    """One window: the batch at t=0, online requests at their arrivals, until every online one ends."""
    scheduler = Scheduler(config, KVCacheManager(KV_BLOCKS, 16, "m"), max_model_len=1024,
                          predictor=LinearStepModel.from_profile({n: times(0, n, 1) for n in (1, 64, 256)}))
    predictor = scheduler.predictor
    assert isinstance(predictor, LinearStepModel)
    noise = random.Random(seed + 7)
    fcfs = config.scheduling_policy == "fcfs"
    for i, (tokens, max_tokens) in enumerate(offline):
        scheduler.add_request(Request(f"off{i}", list(tokens), SamplingParams(max_tokens=max_tokens), frozenset(),
                                      max_tokens, int(fcfs), 0.0, "offline"))
    now, next_online, offline_tokens, last_token = 0.0, 0, 0, {}
    seqs = []
    while True:
        while next_online < len(arrivals) and arrivals[next_online] <= now:
            k = next_online % len(online)
            scheduler.add_request(Request(f"on{next_online}", list(online[k]), SamplingParams(max_tokens=online_max[k]),
                                          frozenset(), online_max[k], 0, arrivals[next_online], "online"))
            next_online += 1
        if now >= duration and not any(rid.startswith("on") for rid in scheduler.requests):
            break
        out = scheduler.schedule() if scheduler.requests else None
        if out is None or not out.num_scheduled_tokens:
            now = arrivals[next_online] if next_online < len(arrivals) else now + 0.005
            continue
        chunks = [n for n in out.num_scheduled_tokens.values() if n > 1]
        seconds = times(len(out.num_scheduled_tokens) - len(chunks), sum(chunks), len(chunks))
        seconds *= 1 + noise.gauss(0, 0.05)
        predictor.observe(scheduler.last_shape, seconds)
        now += seconds
        online_ids = [rid for rid in out.num_scheduled_tokens if rid.startswith("on")]
        seqs.append(len(online_ids))
        cell.idle_steps += not online_ids
        sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
                   if scheduler.requests[rid].num_computed_tokens + n >= scheduler.requests[rid].num_tokens}
        scheduler.update_from_output(out, ModelRunnerOutput(sampled))
        for rid in sampled:
            if rid.startswith("off"):
                offline_tokens += now <= duration
                continue
            index = int(rid[2:])
            if index in last_token:
                cell.itl.append(now - last_token[index])
            else:
                cell.ttft.append(now - arrivals[index])
            last_token[index] = now
    cell.offline_tok_s.append(offline_tokens / duration)
    cell.online_seqs.append(statistics.mean(s for s in seqs if s) if any(seqs) else 0.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def parse_schedules(text: str) -> list[tuple[str, dict]]:
    """"name[:slowdown[:busy steps]]" items; "online-only" and "naive" (fcfs) are built in."""
    schedules: list[tuple[str, dict]] = [("online-only", {})]
    for item in filter(None, text.split(",")):
        name, *knobs = item.split(":")
        config: dict = {"batch": True}
        if name == "naive":
            config["scheduling_policy"] = "fcfs"
        if knobs:
            config["online_slowdown"] = float(knobs[0])
        if len(knobs) > 1:
            config["busy_steps"] = int(knobs[1])
        schedules.append((name, config))
    return schedules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure-grid", default=None, help="time the engine's steps on this machine into this file")
    parser.add_argument("--grid", default="results/step_grid.json")
    parser.add_argument("--loads", default="0.3,0.6,0.9")
    parser.add_argument("--capacity", type=float, default=5.041, help="online requests/s at 100% load")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--offline", type=int, default=2000)
    parser.add_argument("--schedules", default="hybrid,naive",
                        help='comma-separated "name[:online_slowdown[:BUSY_STEPS_TO_RIDE]]" (defaults: the config\'s)')
    ns = parser.parse_args()
    if ns.measure_grid:
        measure_grid(ns.measure_grid)
        return
    with open(ns.grid) as f:
        times = StepTimes(json.load(f))
    tokenizer = load_tokenizer("smollm2-135m")
    limits = LengthLimits(max_output_len=64, max_prompt_len=512)

    def encode(samples: list[SampleRequest]) -> list[tuple[list[int], int]]:
        return [(tokenizer.encode(s.prompt) if isinstance(s.prompt, str) else s.prompt, s.max_tokens) for s in samples]

    online = encode(load_sharegpt(200, tokenizer, limits, seed=0))
    offline = encode(load_humaneval(ns.offline // 2, tokenizer, limits, seed=1)
                     + load_sharegpt(ns.offline - ns.offline // 2, tokenizer, limits, seed=2, split="train"))
    print("| load | schedule | n (TTFT / ITL) | TTFT p50 / p99 ms | ITL p50 / p90 / p99 ms | p99 vs online-only "
          "(TTFT, ITL) | offline tok/s | online seqs a step | idle steps |\n|---|---|---|---|---|---|---|---|---|")
    for load in (float(x) for x in ns.loads.split(",")):
        print_rows(load, run_load(times, ns, load, online, offline))


def run_load(times: StepTimes, ns: argparse.Namespace, load: float, online: list[tuple[list[int], int]],
             offline: list[tuple[list[int], int]]) -> dict[str, Cell]:
    """Every schedule on the same arrivals, seed by seed."""
    default_busy = getattr(hybrid, "BUSY_STEPS_TO_RIDE", 0)  # 0: a checkout of the rules before the busy spell
    cells: dict[str, Cell] = {}
    for seed in range(ns.seeds):
        rng = random.Random(seed * 1000 + int(load * 100))
        arrivals, t = [], rng.expovariate(load * ns.capacity)
        while t < ns.duration:
            arrivals.append(t)
            t += rng.expovariate(load * ns.capacity)
        for name, spec in parse_schedules(ns.schedules):
            knobs = dict(spec)
            hybrid.BUSY_STEPS_TO_RIDE = knobs.pop("busy_steps", default_busy)
            batch = offline if knobs.pop("batch", False) else []
            config = SchedulerConfig(max_offline_queued_tokens=1 << 30, **knobs)
            simulate(times, config, arrivals, [p for p, _ in online], [m for _, m in online], batch,
                     ns.duration, seed, cells.setdefault(name, Cell()))
    hybrid.BUSY_STEPS_TO_RIDE = default_busy
    return cells


def print_rows(load: float, cells: dict[str, Cell]) -> None:
    base = cells["online-only"]
    for name, c in cells.items():
        ratio = (f"{percentile(c.ttft, 99) / percentile(base.ttft, 99):.2f}x, "
                 f"{percentile(c.itl, 99) / percentile(base.itl, 99):.2f}x")
        print(f"| {load:.0%} | {name} | {len(c.ttft)} / {len(c.itl)} | {percentile(c.ttft, 50) * 1e3:.0f} / "
              f"{percentile(c.ttft, 99) * 1e3:.0f} | {percentile(c.itl, 50) * 1e3:.0f} / "
              f"{percentile(c.itl, 90) * 1e3:.0f} / {percentile(c.itl, 99) * 1e3:.0f} | {ratio} | "
              f"{statistics.mean(c.offline_tok_s):.0f} | {statistics.mean(c.online_seqs):.1f} | {c.idle_steps} |",
              flush=True)

if __name__ == "__main__":
    main()
