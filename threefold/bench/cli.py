"""`threefold bench ...`: serve, sweep, report, quality, offline, peers, cost.

Registered on the main CLI by `add_parser(subparsers)`; also runnable alone
as `python -m threefold.bench.cli ...`. Heavy imports happen inside the
command functions so `threefold --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from threefold.config import DEFAULT_MODEL
from threefold.errors import ThreefoldError


def _serve(ns: argparse.Namespace) -> int:
    from threefold.bench.serve import serve_main

    return serve_main(ns)


def _sweep(ns: argparse.Namespace) -> int:
    from threefold.bench.sweep import run_sweep

    return 0 if run_sweep(ns) else 1


def _report(ns: argparse.Namespace) -> int:
    from threefold.bench.report import write_report

    print(write_report(ns.results, ns.out))
    return 0


def _quality(ns: argparse.Namespace) -> int:
    from threefold.bench.quality import quality_main

    return quality_main(ns)


def _offline(ns: argparse.Namespace) -> int:
    from threefold.bench.offline import offline_main

    return offline_main(ns)


def _cost(ns: argparse.Namespace) -> int:
    from threefold.bench.cost import cost_main

    return cost_main(ns)


def _calibrate(ns: argparse.Namespace) -> int:
    from threefold.sim.calibrate import calibrate_main

    return calibrate_main(ns)


def _peers_install(ns: argparse.Namespace) -> int:
    from threefold.bench.peers import PEERS, install

    for peer in PEERS if ns.peer == "all" else [ns.peer]:
        print(f"installing {peer} (log: $THREEFOLD_HOME/peers/logs/install-{peer}.log) ...", flush=True)
        print(f"{peer}: {install(peer, force=ns.force)}")
    return 0


def _peers_convert(ns: argparse.Namespace) -> int:
    from threefold.bench.peers import convert

    print(convert(ns.model, dtype=ns.dtype, force=ns.force))
    return 0


def _peers_serve_cmd(ns: argparse.Namespace) -> int:
    from threefold.bench.peers import serve_command

    command, env = serve_command(ns.peer, ns.model, ns.port, max_model_len=ns.max_model_len, dtype=ns.dtype)
    print(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command)]))
    return 0


def _peers_status(ns: argparse.Namespace) -> int:
    from threefold.bench.peers import status

    print(json.dumps(status(), indent=1))
    return 0


def _add_peers(sub: argparse._SubParsersAction) -> None:
    peers = sub.add_parser("peers", help="install and run the engines we compare against")
    psub = peers.add_subparsers(dest="peers_command", required=True)
    install = psub.add_parser("install", help="create a peer's venv under $THREEFOLD_HOME/peers/")
    install.add_argument("peer", nargs="?", default="all", choices=("vllm", "llamacpp", "all"))
    install.add_argument("--force", action="store_true", help="reinstall from scratch")
    install.set_defaults(func=_peers_install)
    convert = psub.add_parser("convert", help="dequantize a GGUF model to an HF directory (for vLLM, transformers)")
    convert.add_argument("--model", default=DEFAULT_MODEL)
    convert.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    convert.add_argument("--force", action="store_true")
    convert.set_defaults(func=_peers_convert)
    cmd = psub.add_parser("serve-cmd", help="print the command that serves a model with a peer")
    cmd.add_argument("peer", choices=("vllm", "llamacpp", "threefold"))
    cmd.add_argument("--model", default=DEFAULT_MODEL)
    cmd.add_argument("--port", type=int, default=8000)
    cmd.add_argument("--max-model-len", type=int, default=2048)
    cmd.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                     help="compute dtype (threefold, vLLM); auto: bf16 only on CPUs with native bf16")
    cmd.set_defaults(func=_peers_serve_cmd)
    psub.add_parser("status", help="which peers are installed").set_defaults(func=_peers_status)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from threefold.bench.offline import add_offline_args
    from threefold.bench.serve import add_serve_args
    from threefold.bench.sweep import add_sweep_args

    bench = subparsers.add_parser("bench", help="benchmarks: serving load, sweeps, reports, quality, peers")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="drive an OpenAI-compatible server with a workload")
    add_serve_args(serve)
    serve.set_defaults(func=_serve)
    sweep = sub.add_parser("sweep", help="bench serve over concurrencies/rates for several servers")
    add_serve_args(sweep, with_server=False)
    add_sweep_args(sweep)
    sweep.set_defaults(func=_sweep)
    report = sub.add_parser("report", help="markdown table and plots from result JSONs")
    report.add_argument("results", nargs="+")
    report.add_argument("--out", required=True, help="output folder")
    report.set_defaults(func=_report)
    _add_quality(sub)
    offline = sub.add_parser("offline", help="offline batch throughput of threefold / vLLM / transformers")
    add_serve_args(offline, with_server=False)
    add_offline_args(offline)
    offline.add_argument("--out", default=None)
    offline.set_defaults(func=_offline, model=DEFAULT_MODEL)
    _add_peers(sub)
    from threefold.bench.cost import add_cost_args

    cost = sub.add_parser("cost", help="the stacked ablation: cost per million tokens, rung by rung, with verdicts")
    add_cost_args(cost)
    cost.set_defaults(func=_cost)
    from threefold.sim.calibrate import add_calibrate_args

    calibrate = sub.add_parser("calibrate", help="time the real engine's steps; fit the simulator's engine model")
    add_calibrate_args(calibrate)
    calibrate.set_defaults(func=_calibrate)
    return bench


def _add_quality(sub: argparse._SubParsersAction) -> None:
    from threefold.cli import add_engine_args

    quality = sub.add_parser("quality", help="perplexity, KL and top-1 agreement against an fp32 reference")
    add_engine_args(quality)  # the candidate configuration: --model, --dtype, cache and spec knobs
    quality.add_argument("--num-sequences", type=int, default=8)
    quality.add_argument("--seq-len", type=int, default=512)
    quality.add_argument("--batch-size", type=int, default=4)
    quality.add_argument("--label", default=None)
    quality.add_argument("--out", default=None)
    quality.set_defaults(func=_quality)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="threefold")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except ThreefoldError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
