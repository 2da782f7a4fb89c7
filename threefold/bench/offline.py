"""`threefold bench offline`: tokens/s of batch generation with no server in the way.

The same token-id workload goes to each engine, every request generating
exactly its max_tokens (EOS ignored) so the engines do equal work:

    threefold     `LLM.generate` (continuous batching), in this process
    vllm          `LLM.generate` in the vLLM peer venv (bench/vllm_offline_runner.py)
    transformers  `generate` on fixed batches of --batch-size, left-padded: static
                  batching, where a batch runs until its longest request is done
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from threefold.bench.datasets import SampleRequest, Session
from threefold.bench.peers import best_dtype, convert, converted_dir, is_installed, run_as_env, venv_python
from threefold.bench.report import cpu_record
from threefold.bench.serve import build_workload
from threefold.bench.tokenizer import load_tokenizer, resolve_model_path
from threefold.config import DTYPES
from threefold.errors import ThreefoldError

ENGINES = ("threefold", "vllm", "transformers")


def token_workload(args: argparse.Namespace) -> list[dict]:
    """[{"prompt_token_ids", "max_tokens"}] from any single-turn dataset of `bench serve`."""
    tokenizer = load_tokenizer(args.model, args.tokenizer)
    workload = build_workload(args, tokenizer)
    if workload and isinstance(workload[0], Session):
        raise ThreefoldError("offline throughput takes single-turn datasets, not sessions", param="dataset")
    return [{"prompt_token_ids": r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt),
             "max_tokens": r.max_tokens} for r in workload if isinstance(r, SampleRequest)]  # all are: checked above


def _hf_dir(model: str) -> Path:
    path = resolve_model_path(model, pull_if_missing=True)
    return path if path.is_dir() else (converted_dir(model) if (converted_dir(model) / "config.json").is_file()
                                       else convert(model))


def run_threefold(model: str, requests: list[dict], dtype: str, max_model_len: int,
                  kv_cache_dtype: str = "auto", kv_cache_memory: int | None = None,
                  kv_quality_budget: float | None = None, kv_guard_calibration: str | None = None) -> float:
    from threefold.engine.llm import LLM
    from threefold.sample.params import SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory=kv_cache_memory, kv_quality_budget=kv_quality_budget,
              kv_guard_calibration=kv_guard_calibration)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in requests]
    llm.generate(prompts[:1], params[:1])  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


def run_vllm(model: str, requests: list[dict], dtype: str, max_model_len: int, **engine_args) -> float:
    """Seconds vLLM's `LLM.generate` takes over `requests` (engine_args: more `vllm.LLM` keywords; a
    kv_cache_memory_bytes there sizes the KV cache instead of the 4 GiB default)."""
    if not is_installed("vllm"):
        raise ThreefoldError("vLLM peer not installed; run `threefold bench peers install vllm`", param="engine")
    runner = Path(__file__).with_name("vllm_offline_runner.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model_dir": str(_hf_dir(model)), "dtype": dtype, "max_model_len": max_model_len,
                   "requests": requests, "engine_args": engine_args}, f)
    cpus = len(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cpus - 1}", "VLLM_CPU_KVCACHE_SPACE": "4", **run_as_env()}
    if "kv_cache_memory_bytes" in engine_args:
        del env["VLLM_CPU_KVCACHE_SPACE"]  # vLLM's CPU platform lets the variable override the bytes
    try:
        proc = subprocess.run([str(venv_python("vllm")), str(runner), f.name], capture_output=True, text=True,
                              env=env, check=False)  # a failure is reported below with its stderr
    finally:
        os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise ThreefoldError(f"vLLM offline run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])["elapsed_s"]


def run_transformers(model: str, requests: list[dict], dtype: str, batch_size: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(_hf_dir(model)), dtype=getattr(torch, dtype)).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def generate(batch: list[dict]) -> None:
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in batch])
        mask = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + [1] * len(r["prompt_token_ids"])
                             for r in batch])
        new = max(r["max_tokens"] for r in batch)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad)

    generate(requests[:1])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        generate(requests[i:i + batch_size])
    return time.perf_counter() - start


def run_offline(args: argparse.Namespace, requests: list[dict] | None = None) -> dict:
    """One engine on the workload; returns an `offline` result document for `bench report`."""
    requests = requests if requests is not None else token_workload(args)
    # Peers get `auto` made concrete (the same compute dtype for each); threefold keeps its own
    # per-CPU `auto` (fp32 compute over bf16-stored weights on AVX2, see model/precision.py).
    dtype = args.dtype if args.engine == "threefold" else best_dtype(args.dtype)
    args.dtype = dtype  # recorded
    if args.engine == "threefold":
        elapsed = run_threefold(args.model, requests, dtype, args.max_total_len, args.kv_cache_dtype,
                                args.kv_cache_memory, args.kv_quality_budget, args.kv_guard_calibration)
    elif args.engine == "vllm":
        elapsed = run_vllm(args.model, requests, dtype, args.max_total_len)
    else:
        elapsed = run_transformers(args.model, requests, dtype, args.batch_size)
    out_tokens = sum(r["max_tokens"] for r in requests)  # EOS is ignored: each request makes exactly this many
    in_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    return {"kind": "offline", "label": args.label or args.engine, "engine": args.engine,
            "num_prompts": len(requests), "input_tokens": in_tokens, "output_tokens": out_tokens,
            "elapsed_s": elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (in_tokens + out_tokens) / elapsed, "requests_per_s": len(requests) / elapsed,
            "cpu": cpu_record(), "config": {k: v for k, v in vars(args).items() if not callable(v)}}


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="threefold")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="every engine's compute dtype; auto: bf16 only on CPUs with native bf16, else fp32 "
                             "(threefold resolves its own auto: see threefold/model/precision.py)")
    parser.add_argument("--batch-size", type=int, default=16, help="transformers: static batch size")
    from threefold.cli import add_guard_args, parse_bytes
    parser.add_argument("--kv-cache-dtype", default="auto", help="threefold: KV codec spec (see threefold info)")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="threefold: KV budget, e.g. 64MiB")
    add_guard_args(parser)


def offline_main(args: argparse.Namespace) -> int:
    if not args.model:
        raise ThreefoldError("offline needs --model", param="model")
    doc = run_offline(args)
    print(json.dumps({k: v for k, v in doc.items() if k != "config"}))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    return 0
