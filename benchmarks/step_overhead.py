"""Per-step host (Python) overhead with many running sequences, at short and long contexts.

    flock /tmp/threefold-bench.lock .venv/bin/python benchmarks/step_overhead.py \\
        --tree before=/work/main --tree after=. --rounds 2 --out results/step_overhead.json

A step's cost should not grow with the contexts in it except where attention
reads them. This measures the host-side work of an engine step while 256
sequences decode, at a short and a long context, and separates it from the
model's own work:

    schedule      Scheduler.schedule
    build_batch   SchedulerOutput -> tensors (block tables, slots, positions)
    sample_meta   SamplingMetadata.build
    runner_other  the rest of ModelRunner.execute outside the model and sampler
                  (state updates, prompt-logprob checks, output lists)
    update        Scheduler.update_from_output
    outputs       LLMEngine.step's output processing (detokenize, RequestOutputs),
                  plus what the server's engine thread does per output: main's
                  AsyncEngine copies each cumulative output (`_snapshot`); a
                  tree with RequestOutputKind streams deltas instead
    host          the sum of the above (ms per step)
    model         forward + compute_logits + sampler (not host overhead; shown for scale)

The model is a tiny random Llama (1 layer, hidden 64, SmolLM2's tokenizer and
vocab), so the forward is cheap and the host work stands out. The prompts share
a prefix (cached once), so setting up 256 x 2k contexts takes seconds. Each
code tree runs in its own subprocess with its `threefold` first on PYTHONPATH,
and trees are interleaved round by round, so both see the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("schedule", "build_batch", "sample_meta", "runner_other", "update", "outputs")


# ---- the tiny model ------------------------------------------------------------
def tiny_checkpoint(home: Path) -> Path:
    """A 1-layer random Llama with SmolLM2's tokenizer, written once under `home`."""
    path = home / "bench" / "step-overhead-tiny-llama"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from threefold.model.registry import resolve

    gguf = resolve("smollm2-135m")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(path)
    return path


# ---- the worker: one code tree, one configuration --------------------------------
class _Timer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start
        return timed


class _TimedProxy:
    """Times calls of an object (the model, the sampler) and passes everything else through."""

    def __init__(self, inner, timer: _Timer, name: str, methods: tuple[str, ...] = ()) -> None:
        self._inner, self._call = inner, timer.wrap(name, inner)
        for method in methods:
            setattr(self, method, timer.wrap(name, getattr(inner, method)))

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _instrument(engine, timer: _Timer) -> None:
    import threefold.worker.model_runner as model_runner

    core, runner = engine.core, engine.core.runner
    core.scheduler.schedule = timer.wrap("schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = timer.wrap("update", core.scheduler.update_from_output)
    runner.execute = timer.wrap("execute", runner.execute)
    core.step = timer.wrap("core", core.step)
    model_runner.build_batch = timer.wrap("build_batch", model_runner.build_batch)
    build = model_runner.SamplingMetadata.build
    model_runner.SamplingMetadata = type("TimedMetadata", (), {"build": staticmethod(timer.wrap("sample_meta", build))})
    runner.model = _TimedProxy(runner.model, timer, "model", ("compute_logits",))
    runner.sampler = _TimedProxy(runner.sampler, timer, "model")


def _server_handoff():
    """What the server's engine thread does with each output, in this tree."""
    from threefold.engine import async_engine, outputs

    if hasattr(outputs, "RequestOutputKind"):
        return outputs.RequestOutputKind.DELTA, (lambda output: output)
    return None, async_engine._snapshot


def worker(args: argparse.Namespace) -> dict:
    import random

    import torch

    from threefold.engine.llm_engine import EngineArgs, LLMEngine
    from threefold.sample.params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_args(EngineArgs(
        model=args.model, dtype="float32", max_model_len=args.context + args.steps + 64,
        kv_cache_memory=512 << 20, max_num_seqs=args.num_seqs, max_num_batched_tokens=8192))
    kind, handoff = _server_handoff()
    rng = random.Random(0)
    prefix = [rng.randrange(100, 49000) for _ in range(args.context - 16)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 32, ignore_eos=True,
                            repetition_penalty=1.1 if args.penalties else 1.0)
    for i in range(args.num_seqs):
        prompt = prefix + [rng.randrange(100, 49000) for _ in range(16)]
        extra = {} if kind is None else {"output_kind": kind}
        engine.add_request(str(i), prompt, params, **extra)
    while engine.get_stats().num_waiting or _num_prefilling(engine):  # until every sequence decodes
        engine.step()
    for _ in range(3):  # warm-up decodes
        engine.step()
    timer = _Timer()
    _instrument(engine, timer)
    handoff = timer.wrap("handoff", handoff)
    steps = []
    for _ in range(args.steps):
        timer.totals.clear()
        start = time.perf_counter()
        for output in engine.step():
            handoff(output)
        total = time.perf_counter() - start
        steps.append(_phases(timer.totals, total))
    return {"context": args.context, "num_seqs": args.num_seqs, "penalties": args.penalties,
            "running": engine.get_stats().num_running,
            "median_ms": {k: 1e3 * statistics.median(s[k] for s in steps) for k in steps[0]}}


def _num_prefilling(engine) -> int:
    scheduler = engine.core.scheduler
    return sum(1 for r in scheduler.running if r.num_computed_tokens < r.num_prompt_tokens)


def _phases(t: dict[str, float], total: float) -> dict[str, float]:
    phases = {name: t.get(name, 0.0) for name in ("schedule", "build_batch", "sample_meta", "update")}
    phases["runner_other"] = t["execute"] - t["build_batch"] - t["sample_meta"] - t["model"]
    phases["outputs"] = total - t["core"] + t.get("handoff", 0.0)
    phases["host"] = sum(phases[p] for p in PHASES)
    phases["model"] = t["model"]
    return phases


# ---- the driver ----------------------------------------------------------------
def _cpu_record(threads: int) -> dict:
    import torch

    from threefold.cpu import cpu_info

    torch.set_num_threads(threads)
    return cpu_info().as_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH of a checkout (repeatable)")
    parser.add_argument("--contexts", default="128,2048")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--penalties", action="store_true", help="also run with repetition_penalty on every row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--penalty-run", dest="penalty_run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.penalties = args.penalty_run
        print(json.dumps(worker(args)))
        return
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(Path(__file__).resolve().parents[1])}
    home = Path(os.environ.get("THREEFOLD_HOME", Path.home() / ".threefold"))
    model = tiny_checkpoint(home)
    configs = [(int(c), p) for c in args.contexts.split(",") for p in ([False, True] if args.penalties else [False])]
    runs: list[dict] = []
    for round_index in range(args.rounds):
        for context, penalties in configs:
            for label, tree in trees.items():
                result = _run_worker(tree, model, context, penalties, args)
                result.update(tree=label, round=round_index)
                runs.append(result)
                print(json.dumps(result), flush=True)
    report = {"cpu": _cpu_record(args.threads), "command": " ".join(sys.argv), "runs": runs}
    print(_table(runs, list(trees), configs))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


def _run_worker(tree: str, model: Path, context: int, penalties: bool, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_WAIT_POLICY="PASSIVE")
    command = [sys.executable, __file__, "--worker", "--model", str(model), "--context", str(context),
               "--num-seqs", str(args.num_seqs), "--steps", str(args.steps), "--threads", str(args.threads)]
    if penalties:
        command.append("--penalty-run")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker for {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(runs: list[dict], labels: list[str], configs: list[tuple[int, bool]]) -> str:
    """Median over rounds of each phase's per-step median, ms."""
    columns = [*PHASES, "host", "model"]
    lines = ["| tree | context | penalties | " + " | ".join(columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for context, penalties in configs:
        for label in labels:
            mine = [r for r in runs if r["tree"] == label and r["context"] == context and r["penalties"] == penalties]
            values = [statistics.median(r["median_ms"][c] for r in mine) for c in columns]
            lines.append(f"| {label} | {context} | {'yes' if penalties else 'no'} | "
                         + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
