"""`threefold bench serve`: build a workload, drive a server with it, save what was measured.

The saved JSON holds the exact configuration (every flag, the resolved model
name, workload statistics), the summary and one row per request, so a report
can be redrawn, and a run repeated, from the file alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import platform
from pathlib import Path
from urllib.parse import urlsplit

from threefold.bench.client import RequestResult
from threefold.bench.datasets import (
    DATASETS,
    LengthLimits,
    SampleRequest,
    Session,
    load_humaneval,
    load_random,
    load_sharegpt,
    load_sharegpt_sessions,
)
from threefold.bench.loadgen import LoadConfig, fetch_model_name, run_requests, run_sessions
from threefold.bench.metrics import SLO, format_summary, summarize
from threefold.bench.report import UNKNOWN_CPU, cpu_record
from threefold.bench.tokenizer import load_tokenizer
from threefold.errors import ThreefoldError

RESULT_FORMAT = 1


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"request rate must be positive or inf, got {text}")
    return value


def add_serve_args(parser: argparse.ArgumentParser, with_server: bool = True) -> None:
    """Flags of `bench serve`; sweep reuses them without --base-url/--request-rate/--max-concurrency."""
    if with_server:
        parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
        parser.add_argument("--request-rate", type=_rate, default=math.inf,
                            help="Poisson arrivals per second (inf: all at once)")
        parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
        parser.add_argument("--out", default=None, help="write the results JSON here")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--tokenizer", default=None, help="HF dir or .gguf for counting tokens")
    parser.add_argument("--label", default=None, help="name of this configuration in reports")
    parser.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    parser.add_argument("--dataset-path", default=None, help="another ShareGPT V3 JSON file")
    parser.add_argument("--split", choices=("test", "train", "all"), default="test",
                        help="ShareGPT split (every 5th record is test)")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests (sessions for sharegpt-sessions)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                        help="default: chat for sessions, completions otherwise")
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-total-len", type=int, default=2048)
    parser.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="random: output tokens")
    parser.add_argument("--random-mode", choices=("tokens", "words"), default="tokens")
    parser.add_argument("--min-turns", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--think-time", type=float, default=1.0, help="sessions: mean think time, seconds")
    parser.add_argument("--session-context-len", type=int, default=0,
                        help="sessions: open each with its own document of this many tokens (a system message), "
                             "so later turns re-read a long context (KV tiers)")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, threefold)")
    parser.add_argument("--suppress-eos", action="store_true",
                        help="send logit_bias -100 on the tokenizer's special tokens (llama.cpp ignores ignore_eos)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    parser.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--no-progress", action="store_true")


def build_workload(args: argparse.Namespace, tokenizer) -> list[SampleRequest] | list[Session]:
    limits = LengthLimits(args.max_output_len, 4, args.max_prompt_len, args.max_total_len)
    if args.dataset == "sharegpt":
        return load_sharegpt(args.num_prompts, tokenizer, limits, args.seed, args.split, args.dataset_path)
    if args.dataset == "sharegpt-sessions":
        return load_sharegpt_sessions(args.num_prompts, tokenizer, limits, args.seed, args.min_turns,
                                      args.max_turns, args.split, args.dataset_path, args.session_context_len)
    if args.dataset == "humaneval":
        return load_humaneval(args.num_prompts, tokenizer, limits, args.seed)
    return load_random(args.num_prompts, tokenizer, args.input_len, args.output_len, args.seed, args.random_mode)


def workload_stats(workload: list) -> dict:
    if workload and isinstance(workload[0], Session):
        turns = [len(s.user_turns) for s in workload]
        return {"num_sessions": len(workload), "num_turns": sum(turns), "mean_turns": sum(turns) / len(turns),
                "session_context_len": workload[0].system_len}
    return {"num_requests": len(workload),
            "mean_prompt_len": sum(r.prompt_len for r in workload) / max(len(workload), 1),
            "mean_max_tokens": sum(r.max_tokens for r in workload) / max(len(workload), 1)}


def _request_row(r: RequestResult) -> dict:
    return {"start": r.start, "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e, "prompt_len": r.prompt_len,
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens,
            "cached_tokens_by_tier": r.cached_tokens_by_tier,
            "num_chunks": len(r.itl) + (1 if r.ttft is not None else 0), "turn": r.turn,
            "session_id": r.session_id, "error": r.error}


async def _warm_up(workload: list, cfg: LoadConfig, num: int) -> None:
    if num <= 0 or not workload:
        return
    quiet = dataclasses.replace(cfg, progress=False, request_rate=math.inf, max_concurrency=1)
    if isinstance(workload[0], Session):
        # Warm-ups drop the session's document: it must not be in the cache before the measured turns.
        first = [Session(s.session_id, s.user_turns[:1], [min(s.max_tokens[0], 16)]) for s in workload[:num]]
        await run_sessions(first, dataclasses.replace(quiet, think_time=0.0))
    else:
        await run_requests([dataclasses.replace(r, max_tokens=min(r.max_tokens, 16)) for r in workload[:num]], quiet)


async def run_serve(args: argparse.Namespace) -> dict:
    """Run one benchmark as configured by `args`; returns the results document."""
    model = args.model or await fetch_model_name(args.base_url)
    tokenizer = load_tokenizer(model, args.tokenizer)
    workload = build_workload(args, tokenizer)
    sessions = args.dataset == "sharegpt-sessions"
    endpoint = "chat" if sessions else (args.endpoint or "completions")
    bias = {str(i): -100.0 for i in tokenizer.all_special_ids} if args.suppress_eos else None
    cfg = LoadConfig(args.base_url, model, endpoint, args.request_rate, args.max_concurrency, args.ignore_eos,
                     args.temperature, args.think_time, args.seed, args.timeout, not args.no_progress, bias)
    await _warm_up(workload, cfg, args.num_warmups)
    started = datetime.datetime.now(datetime.UTC).isoformat()
    skipped = 0
    if sessions:
        results, duration, skipped = await run_sessions([s for s in workload if isinstance(s, Session)], cfg)
    else:  # the dataset decides the kind: the filters keep every item
        results, duration = await run_requests([r for r in workload if isinstance(r, SampleRequest)], cfg)
    summary = summarize(results, duration, SLO(args.slo_ttft, args.slo_tpot), skipped)
    config = {**vars(args), "model": model, "endpoint": endpoint}
    doc = result_document(config, args.label or model, workload_stats(workload), results, summary)
    doc["started_at"] = started
    doc["cpu"] = server_cpu(args.base_url)
    return doc


def server_cpu(base_url: str) -> dict:
    """The server's CPU where we can know it: ours when it runs here (sweeps start servers here)."""
    if urlsplit(base_url).hostname in ("127.0.0.1", "localhost", "::1", platform.node()):
        return cpu_record()
    return {**UNKNOWN_CPU, "model": f"remote server {base_url}: not recorded", "client": cpu_record()}


def result_document(config: dict, label: str, workload: dict, results: list[RequestResult],
                    summary: dict) -> dict:
    """The saved form of one run (what `bench report` reads)."""
    config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
              for k, v in config.items() if not callable(v)}
    return {"format": RESULT_FORMAT, "kind": "serve", "label": label, "host": platform.node(), "config": config,
            "workload": workload, "summary": summary, "requests": [_request_row(r) for r in results]}


def write_results(document: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))
    return path


def serve_main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ThreefoldError("--num-prompts must be at least 1", param="num_prompts")
    document = asyncio.run(run_serve(args))
    print(format_summary(document["summary"]))
    if args.out:
        print(f"results: {write_results(document, args.out)}")
    return 0 if document["summary"]["completed"] else 1
