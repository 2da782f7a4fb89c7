"""Offline batch throughput of threefold, vLLM (CPU) and transformers on one workload, interleaved.

    .venv/bin/python benchmarks/offline_peers.py --model smollm2-135m --num-prompts 32 \
        --engines threefold,vllm,transformers --rounds 2 --out-dir results/offline

An engine may name its own dtype, `engine:dtype` (e.g. threefold:auto,threefold:bf16-weights,
transformers:float32); the others take --dtype.

Each engine generates exactly each request's max_tokens (EOS ignored) for the
same token ids; one JSON line per run is printed and saved as
DIR/offline_<engine>_round<k>.json, then `bench report` writes DIR/report.md.
vLLM runs in its peer venv ($THREEFOLD_HOME/peers/vllm: `threefold bench peers install vllm`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from threefold.bench.offline import ENGINES, add_offline_args, run_offline, token_workload
from threefold.bench.report import write_report
from threefold.bench.serve import add_serve_args
from threefold.config import DEFAULT_MODEL
from threefold.cpu import apply_run_as


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(parser, with_server=False)
    add_offline_args(parser)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out-dir", default="results/offline")
    parser.set_defaults(model=DEFAULT_MODEL, num_prompts=32)
    args = parser.parse_args()
    apply_run_as()  # $THREEFOLD_CPU_CLASS: threefold, transformers and the vLLM peer all take the capped ISA
    requests = token_workload(args)  # one workload for every engine and round
    out, paths = Path(args.out_dir), []
    out.mkdir(parents=True, exist_ok=True)
    base_dtype = args.dtype
    for rnd in range(args.rounds):
        for spec in args.engines.split(","):  # engine or engine:dtype, e.g. threefold:auto
            engine, _, dtype = spec.partition(":")
            args.engine, args.dtype, args.label = engine, dtype or base_dtype, spec
            doc = run_offline(args, requests)
            print(json.dumps({k: v for k, v in doc.items() if k != "config"}), flush=True)
            path = out / f"offline_{spec.replace(':', '-')}_round{rnd}.json"
            path.write_text(json.dumps(doc, indent=1, default=str))
            paths.append(path)
    print(f"report: {write_report(paths, out)}")


if __name__ == "__main__":
    main()
