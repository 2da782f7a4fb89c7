"""`threefold` command line: generate, chat, pull, models, serve, bench."""

from __future__ import annotations

import argparse
import os
import sys
import uuid

from threefold.config import (
    DTYPES,
    SCHEDULING_POLICIES,
    SERVING_PREFILL_TOKENS,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
)
from threefold.env import Env
from threefold.errors import ThreefoldError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine knobs shared by generate, chat and serve; every default is read from threefold/config.py."""
    model, cache, sched = ModelConfig(), CacheConfig(), SchedulerConfig()
    parser.add_argument("--model", default=model.model, help="registry name, GGUF file or HF directory")
    parser.add_argument("--dtype", default=model.dtype, choices=DTYPES)
    parser.add_argument("--max-model-len", type=int, default=model.max_model_len)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=cache.kv_cache_memory,
                        help="e.g. 2GiB, 512MiB or bytes (default: a share of free RAM)")
    parser.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens,
                        help="tokens per step: prefill chunks and decodes together")
    parser.add_argument("--max-prefill-tokens", type=int, default=sched.max_prefill_tokens,
                        help="most prompt tokens per step while other requests wait or run "
                             f"(default: {SERVING_PREFILL_TOKENS} for serve, no cap elsewhere)")
    parser.add_argument("--scheduling-policy", default=sched.scheduling_policy, choices=SCHEDULING_POLICIES,
                        help="hybrid: online first, offline (batch) work fills the latency budget left; "
                             "fcfs: offline mixes in like online")
    parser.add_argument("--online-ttft-slo", default=sched.online_ttft_slo,
                        help="online time-to-first-token target offline work must keep, e.g. 1s or 500ms")
    parser.add_argument("--online-itl-slo", default=sched.online_itl_slo,
                        help="online inter-token latency target offline work must keep, e.g. 100ms")
    parser.add_argument("--offline-min-share", type=float, default=sched.offline_min_share,
                        help="share of the tokens online computes that offline work always gets (its floor)")
    parser.add_argument("--online-slowdown", type=float, default=sched.online_slowdown,
                        help="most offline work may lengthen a step of online decodes, as a share of its time "
                             "alone (0.2 = 20%%; higher: more offline throughput, slower online)")
    parser.add_argument("--max-offline-queued-tokens", type=int, default=sched.max_offline_queued_tokens,
                        help="most prompt + max_tokens of unfinished offline requests")
    parser.add_argument("--block-size", type=int, default=cache.block_size)
    parser.add_argument("--kv-cache-dtype", default=cache.kv_cache_dtype,
                        help="KV codec: auto, int8, fp8 (=fp8_e4m3), fp8_e5m2, int4, kivi2, kivi4, gear, turboquant; "
                             "parameters as name:key=value, e.g. kivi4:residual=64 (threefold.kv.spec lists them); "
                             "a per-layer mix mix:SPEC@LAYERS;...; or guard:BASE (with --kv-quality-budget)")
    add_guard_args(parser)
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=cache.enable_prefix_caching)
    parser.add_argument("--seed", type=int, default=model.seed)
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' '
                             "(methods: ngram, draft_model, medusa, eagle)")
    parser.add_argument("--step-log", default=None, metavar="FILE",
                        help="append each model step's time and shape to FILE, one JSON line a step (what the "
                             "simulator's engine model prices: compare a server's steps with a calibration)")
    from threefold.kvstore import add_offload_args
    add_offload_args(parser)  # --kv-offload-cpu-bytes/-disk/-disk-bytes/-redis/-codec/-config (issue 12)


def add_guard_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-quality-budget", type=float, default=None,
                        help="guard: specs: mean KL (nats/token) the calibrated per-layer mix may add against auto, "
                             "e.g. 0.01")
    parser.add_argument("--kv-guard-calibration", default=None, metavar="FILE",
                        help="guard: specs: text file to calibrate on (default: ShareGPT train split)")


def engine_args_from(ns: argparse.Namespace):
    from threefold.engine.llm_engine import EngineArgs
    from threefold.kvstore import OffloadConfig
    offload = OffloadConfig.from_args(ns)
    return EngineArgs(model=ns.model, dtype=ns.dtype, max_model_len=ns.max_model_len,
                      kv_cache_memory=ns.kv_cache_memory, block_size=ns.block_size, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens, max_prefill_tokens=ns.max_prefill_tokens,
                      enable_prefix_caching=ns.enable_prefix_caching, seed=ns.seed,
                      kv_cache_dtype=ns.kv_cache_dtype, kv_quality_budget=ns.kv_quality_budget,
                      kv_guard_calibration=ns.kv_guard_calibration,
                      speculative_config=getattr(ns, "speculative_config", None),
                      scheduling_policy=ns.scheduling_policy, online_ttft_slo=ns.online_ttft_slo,
                      online_itl_slo=ns.online_itl_slo, offline_min_share=ns.offline_min_share,
                      max_offline_queued_tokens=ns.max_offline_queued_tokens, online_slowdown=ns.online_slowdown,
                      kv_offload=offload if offload.enabled else None, step_log=getattr(ns, "step_log", None))


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    lowered = text.strip().lower()
    number = lowered.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = lowered[len(number):]
    if unit not in _UNITS or not number:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size; write e.g. 2GiB, 512MiB or 1000000")
    return int(float(number) * _UNITS[unit])


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")


def _params(ns: argparse.Namespace):
    from threefold.sample.params import SamplingParams
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, seed=ns.sample_seed)


def cmd_generate(ns: argparse.Namespace) -> int:
    from threefold.engine.llm import LLM
    llm = LLM.from_engine_args(engine_args_from(ns))
    prompts = ns.prompt or ["The three most useful things to know about paged attention are"]
    if ns.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], _params(ns))
    else:
        outputs = llm.generate(prompts, _params(ns))
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        print(f"### prompt: {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason}]")
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from threefold.engine.chat import run_chat
    return run_chat(engine_args_from(ns), _params(ns), session_id=uuid.uuid4().hex)


def cmd_pull(ns: argparse.Namespace) -> int:
    from threefold.model.registry import pull
    for name in ns.names:
        print(pull(name))
    return 0


def cmd_models(ns: argparse.Namespace) -> int:
    from threefold.model.registry import list_models
    print(f"{'name':<22} {'size':>10}  pulled  path")
    for info in list_models():
        size = f"{info.size_bytes / 2**20:.0f} MiB" if info.size_bytes else "?"
        print(f"{info.name:<22} {size:>10}  {'yes' if info.pulled else 'no':<6}  {info.path or ''}")
    return 0


def cmd_info(ns: argparse.Namespace) -> int:
    """What a KV budget holds under each codec, for one model (reads its config, not its weights)."""
    from threefold.kv.capacity import arch_config, capacity_rows
    config = arch_config(ns.model, ns.dtype)
    budget = ns.kv_cache_memory or 256 << 20
    print(f"{ns.model}: {config.num_layers} layers, {config.num_kv_heads} KV heads x {config.head_dim}, "
          f"{str(config.dtype).removeprefix('torch.')}; KV budget {budget / 2**20:.0f} MiB, "
          f"max_model_len {ns.max_model_len or config.max_position_embeddings}")
    rows = capacity_rows(config, budget, ns.block_size, max_model_len=ns.max_model_len)
    width = max(28, *(len(row["kv_cache_dtype"]) for row in rows))
    print(f"{'kv_cache_dtype':<{width}} {'bytes/token':>12} {'tokens':>10} {'vs auto':>8} {'max seqs':>9}")
    for row in rows:
        print(f"{row['kv_cache_dtype']:<{width}} {row['bytes_per_token']:>12.0f} {row['capacity_tokens']:>10} "
              f"{row['capacity_tokens'] / max(rows[0]['capacity_tokens'], 1):>7.2f}x {row['max_num_seqs']:>9}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="threefold", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="may repeat; default: a demo prompt")
    gen.add_argument("--chat-template", action="store_true", help="wrap each prompt in the chat template")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat; tokens stream as they come")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=512)
    pull_parser = sub.add_parser("pull", help="install and assemble a named model")
    pull_parser.add_argument("names", nargs="+")
    pull_parser.set_defaults(func=cmd_pull)
    sub.add_parser("models", help="list named models").set_defaults(func=cmd_models)
    info = sub.add_parser("info", help="KV-cache capacity of a model under each kv_cache_dtype")
    info.add_argument("--model", default="smollm2-135m")
    info.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    info.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="budget; default 256MiB")
    info.add_argument("--block-size", type=int, default=16)
    info.add_argument("--max-model-len", type=int, default=None,
                      help="the length KIVI's window share is planned for; default the model's")
    info.set_defaults(func=cmd_info)
    train = sub.add_parser("train-draft", help="train Medusa heads or an EAGLE head for a target (ShareGPT train)")
    _train_args(train)
    _add_optional(sub, "threefold.server.cli")
    _add_optional(sub, "threefold.bench.cli")
    _add_optional(sub, "threefold.server.batch_cli")
    _add_optional(sub, "threefold.sim.cli")
    _add_optional(sub, "threefold.router.cli")
    return parser


def _train_args(parser: argparse.ArgumentParser) -> None:
    from threefold.spec.train import add_arguments, run
    add_arguments(parser)
    parser.set_defaults(func=lambda ns: (run(ns), 0)[1])


def _add_optional(sub, module: str) -> None:
    import importlib
    try:
        importlib.import_module(module).add_parser(sub)
    except ImportError as exc:  # a part not installed must not break the others
        print(f"warning: {module} unavailable: {exc}", file=sys.stderr)


def quiet_openmp() -> None:
    """Idle OpenMP threads sleep instead of spinning. On a small shared CPU (2 cores, a
    server and its clients, CI) spinning threads wait a whole timeslice on each other and
    small matmuls run ~20x slower (measured). Set before torch loads; users may override."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    quiet_openmp()
    if Env.read().cpu_class:  # before torch runs anything; peers started from here inherit it
        from threefold.cpu import apply_run_as

        apply_run_as()
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ThreefoldError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
