"""`threefold bench cost`: the stacked ablation. Who truly cuts cost, by how much, at what quality.

One job, one workload (bench/cost_workload.py), a ladder of configurations (bench/cost_rungs.py):

    hf -> cb -> +prefix -> +codec -> +spec -> +tiers -> 2 replicas: rr vs router
    and each technique alone from cb

Per rung: output tok/s, TTFT and ITL p50/p99, peak RSS of the serving processes, KL and top-1
agreement against the fp32 no-technique engine, HumanEval pass@1 (executed), the share of
greedy outputs identical to cb's, and cost per million output tokens at --cost-per-hour.
Writes DIR/cost.md, DIR/cost.json and DIR/cost_waterfall.png, with a verdict per technique
(rule: bench/cost_report.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from threefold.bench.cost_plot import stacked_chain, waterfall
from threefold.bench.cost_report import RULE, markdown, rung_row, same_outputs, verdicts
from threefold.bench.cost_run import RunConfig, RungRun, run_rung
from threefold.bench.cost_rungs import DEFAULT_LADDER, Rung, comparisons, parse_rungs
from threefold.bench.cost_workload import Played, Traffic, Workload, build_workload
from threefold.bench.datasets import LengthLimits
from threefold.config import DEFAULT_MODEL
from threefold.errors import ThreefoldError

PEAK_MEMORY_METHOD = ("sum of VmHWM (/proc/PID/status, resident-set high-water mark) over the serving processes "
                      "(each server's process group, and the router's), read after the workload, before stopping")


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a price per hour such as 0.50, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"a price per hour must be a finite number > 0, got {text!r}")
    return value


def add_cost_args(parser: argparse.ArgumentParser) -> None:
    from threefold.cli import parse_bytes

    parser.add_argument("--rungs", default=DEFAULT_LADDER, help="comma-separated rungs, e.g. hf,cb,cb+prefix "
                        "(techniques: prefix, codec, spec, tiers, rr, router; see bench/cost_rungs.py)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", help="threefold's dtype (the baseline runs transformers fp32)")
    parser.add_argument("--cost-per-hour", type=_price, default=0.50, help="price of the machine per hour")
    parser.add_argument("--codec", default="int8", help="what 'codec' means: a KV codec spec")
    parser.add_argument("--spec-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                        help="what 'spec' means: speculative_config JSON")
    parser.add_argument("--router-policy", default="dualmap", help="what 'router' means (rr is round_robin)")
    parser.add_argument("--tier-cpu-bytes", type=parse_bytes, default=1 << 30, help="what 'tiers' means: L2 size")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=64 << 20, help="every rung's KV budget")
    parser.add_argument("--max-model-len", type=int, default=1280)
    parser.add_argument("--sessions", type=int, default=4, help="ShareGPT multi-turn sessions")
    parser.add_argument("--first-turns", type=int, default=8, help="ShareGPT first turns")
    parser.add_argument("--humaneval", type=int, default=6, help="HumanEval prompts")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-output-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-total-len", type=int, default=1024)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s per stream")
    parser.add_argument("--think-time", type=float, default=0.5, help="sessions: mean seconds between turns")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="the baseline's static batch size")
    parser.add_argument("--quality-sequences", type=int, default=4, help="held-out sequences for KL (0: skip)")
    parser.add_argument("--quality-len", type=int, default=256)
    parser.add_argument("--noise", type=float, default=0.05, help="verdict threshold (fraction)")
    parser.add_argument("--in-process", action="store_true",
                        help="servers in this process over one loaded model (quick; no peak memory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="results/cost")


def _check(ns: argparse.Namespace, rungs: list[Rung]) -> None:
    """Every bad option fails here, before anything loads."""
    from threefold.kv.spec import parse_kv_spec
    from threefold.router.policies import policy_names
    from threefold.spec.config import SpeculativeConfig

    parse_kv_spec(ns.codec)
    SpeculativeConfig.parse(ns.spec_config)
    if any(r.has("codec") and r.has("spec") for r in rungs) and ns.codec.startswith("kivi"):
        raise ThreefoldError(f"--codec {ns.codec}: KIVI codecs refuse speculative decoding in this engine, and a rung "
                             f"stacks codec and spec; use --codec int8 or drop those rungs", param="codec")
    if any(r.has("router") for r in rungs) and ns.router_policy not in policy_names():
        raise ThreefoldError(f"unknown --router-policy {ns.router_policy!r}; choose one of {policy_names()}",
                             param="router_policy")
    counts = (ns.sessions, ns.first_turns, ns.humaneval)
    if min(counts) < 0 or sum(counts) == 0:
        raise ThreefoldError("the workload is empty: give --sessions, --first-turns or --humaneval", param="sessions")
    if not 0 < ns.noise < 1 or ns.quality_sequences < 0 or ns.hf_batch_size < 1:
        raise ThreefoldError("--noise must be in (0, 1), --quality-sequences >= 0, --hf-batch-size >= 1",
                             param="noise")


def _run_config(ns: argparse.Namespace, rungs: list[Rung]) -> RunConfig:
    hf_dir = ""
    if any(r.is_baseline for r in rungs):
        from threefold.bench.offline import _hf_dir

        hf_dir = str(_hf_dir(ns.model))
    return RunConfig(ns.model, hf_dir, ns.dtype, "float32", ns.kv_cache_memory, ns.max_model_len, ns.codec,
                     ns.spec_config, ns.tier_cpu_bytes, ns.router_policy, ns.cost_per_hour, ns.hf_batch_size,
                     log_dir=Path(ns.out_dir) / "logs")


def _run_all(ns, rungs: list[Rung], cfg: RunConfig, workload: Workload, traffic: Traffic,
             loaded: Any) -> tuple[dict[str, RungRun], Any]:
    """Every rung's run, and the model loaded for in-process servers (None in process mode)."""
    if not ns.in_process:
        loaded = None
    elif loaded is None and any(not r.is_baseline for r in rungs):
        from threefold.model.loader import load_model

        loaded = load_model(ns.model, dtype=ns.dtype, max_model_len=ns.max_model_len)
    runs = {}
    for rung in rungs:
        start = time.perf_counter()
        print(f"[bench cost] {rung.name} ...", flush=True)
        try:
            if loaded is not None and not rung.is_baseline:
                from threefold.bench.cost_inproc import run_in_process

                runs[rung.name] = run_in_process(loaded, rung, cfg, workload, traffic)
            else:
                runs[rung.name] = run_rung(rung, cfg, workload, traffic)
        except (ThreefoldError, OSError, httpx.HTTPError) as err:  # one broken rung must not sink the ladder
            print(f"[bench cost] {rung.name} failed: {err}", file=sys.stderr, flush=True)
            runs[rung.name] = RungRun(Played([], [], 0.0), 0, 0, error=str(err)[-2000:])
        played = runs[rung.name].played
        print(f"[bench cost] {rung.name}: {sum(r.ok for r in played.results)}/{len(played.results)} ok in "
              f"{played.duration_s:.1f} s ({time.perf_counter() - start:.0f} s with startup)", flush=True)
    return runs, loaded


def _rows(ns, rungs: list[Rung], runs: dict[str, RungRun], workload: Workload, loaded: Any) -> list[dict]:
    from threefold.bench.cost_quality import humaneval_problems, pass_at_1, quality_table

    rows = [rung_row(r.name, runs[r.name], ns.cost_per_hour) for r in rungs]
    problems = humaneval_problems() if workload.humaneval else {}
    asked = len({r.source_id for r in workload.humaneval})
    table = {}
    if ns.quality_sequences:
        codecs = [ns.codec] if any(r.has("codec") for r in rungs) else []
        hf_dir = _run_config(ns, rungs).hf_dir or None
        fp32_model = loaded if ns.dtype == "float32" else None
        table = quality_table(ns.model, ns.dtype, codecs, hf_dir, ns.quality_sequences, ns.quality_len,
                              fp32_model=fp32_model)
    for rung, row in zip(rungs, rows, strict=True):
        run = runs[rung.name]
        row["pass_at_1"] = pass_at_1(run.played.humaneval_texts, problems, asked)["pass_at_1"] if asked else None
        row["same_as_cb"] = same_outputs(run, runs["cb"]) if "cb" in runs else None
        key = "hf" if rung.is_baseline else (ns.codec if rung.has("codec") else "auto")
        row["quality"] = table.get(key)
    return rows


def run_cost(ns: argparse.Namespace, loaded: Any = None) -> dict:
    """The whole job; `loaded`: a model already loaded at --dtype, for --in-process (tests share one)."""
    rungs = parse_rungs(ns.rungs)
    _check(ns, rungs)
    from threefold.bench.report import cpu_record
    from threefold.bench.tokenizer import load_tokenizer

    cfg = _run_config(ns, rungs)
    limits = LengthLimits(ns.max_output_len, 4, ns.max_prompt_len, ns.max_total_len)
    workload = build_workload(load_tokenizer(ns.model), ns.sessions, ns.first_turns, ns.humaneval, ns.max_turns,
                              limits, ns.seed)
    traffic = Traffic(ns.request_rate, ns.think_time, ns.seed)
    runs, loaded = _run_all(ns, rungs, cfg, workload, traffic, loaded)
    rows = _rows(ns, rungs, runs, workload, loaded)
    by_name = {row["rung"]: row for row in rows}
    verdict_rows = verdicts(comparisons(rungs), by_name, ns.noise)
    chain = [(label, by_name[r.name]["cost_per_m_output_tokens"]) for r, label in stacked_chain(rungs)]
    return {"kind": "cost", "mode": "in-process" if ns.in_process else "processes",
            "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                       for k, v in vars(ns).items() if not callable(v)},
            "cpu": cpu_record(), "workload": workload.stats(), "rungs": rows, "verdicts": verdict_rows,
            "verdict_rule": RULE.format(noise=ns.noise), "chain": chain, "argv": sys.argv,
            "peak_memory_method": "not measured in-process" if ns.in_process else PEAK_MEMORY_METHOD}


def _header(doc: dict) -> str:
    cpu, w = doc["cpu"], doc["workload"]
    return (f"CPU class {cpu['cpu_class']}: {cpu['model']} (torch {cpu.get('torch_capability')}, "
            f"{cpu.get('num_threads')} threads); {doc['config']['model']}; {w['requests']} requests "
            f"({w['sessions']} sessions / {w['session_turns']} turns, {w['first_turns']} first turns, "
            f"{w['humaneval']} HumanEval), {w['output_tokens']} output tokens per rung; "
            f"${doc['config']['cost_per_hour']:.2f}/hour; mode: {doc['mode']}")


def cost_main(ns: argparse.Namespace, loaded: Any = None) -> int:
    doc = run_cost(ns, loaded)
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(doc["rungs"], doc["verdicts"], _header(doc), doc["verdict_rule"])
    (out / "cost.md").write_text(table + "\n")
    chain = [(label, cost) for label, cost in doc["chain"] if cost is not None]
    if chain:
        doc["waterfall"] = str(waterfall(chain, out / "cost_waterfall.png",
                                         f"Where the cost went ({doc['config']['model']}, {doc['cpu']['cpu_class']})"))
    (out / "cost.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table)
    print(f"wrote {out / 'cost.md'}, {out / 'cost.json'}" + (f", {doc['waterfall']}" if "waterfall" in doc else ""))
    return 0 if all(row["completed"] for row in doc["rungs"]) else 1
