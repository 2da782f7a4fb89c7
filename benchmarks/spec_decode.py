"""Speculative decoding, on vs off in the same run: output tok/s, acceptance, inter-token latency.

    flock /tmp/threefold-bench.lock .venv/bin/python benchmarks/spec_decode.py \
        --methods ngram,eagle,eagle-tree,medusa,medusa-tree --heads-dir $THREEFOLD_HOME/heads --out results/spec.json

    # The draft-model pair, batch 1, with transformers plain vs assisted generation in the same run:
    python benchmarks/spec_decode.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \
        --methods draft,draft:6,draft:6:fixed,ngram --workloads humaneval --concurrency 1 --peers

For each workload (HumanEval prompts, greedy; ShareGPT *test*-split first turns, chat
template, greedy) and each concurrency (1, 8, 32: a closed loop keeping that many
requests in flight), every configuration runs over the same requests, interleaved
(off, then each method; every other round in reverse order), in one process over one loaded model.
Batch 1 runs the first --batch1-prompts (6); concurrency c runs c x --waves prompts, refilled as
they finish, so the cell is a steady state (a finished request's slot goes to the next
prompt) rather than one batch's makespan, which speculation can only lengthen.

    tok/s        output tokens / wall time of the whole run
    mean k       draft tokens / drafts: the speculation length the (adaptive) controller chose
    accept len   1 + accepted / drafts: tokens per verify step (vLLM's mean acceptance length)
    per pos      acceptance rate of draft position 1, 2, ...
    ITL p50/p99  gaps between successive outputs of a request (a verify emitting several
                 tokens at once is one output, as a streaming client sees it)

A method is NAME[@HEADS][:K][:vN][:int8][:fixed]: `draft:6` drafts up to 6 tokens, `:fixed` turns the
adaptive controller off (always K), `:int8` streams the draft model's weights as int8 (`quantization`),
`:v4096` drafts over a 4,096-token draft vocabulary (heads: theirs, without it their default; `draft`: the
ShareGPT train split's most frequent tokens, without it the whole vocabulary; `:v0` the whole vocabulary),
`eagle@smollm2-135m-eagle-v1` takes that heads directory under --heads-dir
(two heads of one method side by side). `draft` is the draft model (--draft-model) with the target's tokenizer.
--peers adds, at batch 1, transformers on the same pair (the GGUFs converted to HF directories by
`threefold bench peers convert`), plain `generate` and assisted `generate(assistant_model=draft)`
(its default assistant settings), greedy, the same prompt ids and max tokens, in this process
(the same torch and threads), interleaved with the engines round by round. --vllm adds vLLM CPU
plain and with the same draft model (`benchmarks/spec_vllm.py`, in the vLLM peer venv), batch 1,
before the engines are built, its configurations one after another in their own process.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from threefold.cpu import cpu_info
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.model.loader import load_model
from threefold.sample.params import SamplingParams


def humaneval_prompts(num: int) -> list[str]:
    from threefold.bench.datasets import humaneval_path

    with gzip.open(humaneval_path(), "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:num]


def sharegpt_prompts(tokenizer, num: int) -> list[str]:
    from threefold.bench.sharegpt import dialogue, open_sharegpt

    prompts = []
    for record in open_sharegpt().iter_records("test", seed=0):
        turns = dialogue(record)
        if turns and len(turns[0][0]) < 2000:
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": turns[0][0]}]))
        if len(prompts) == num:
            return prompts
    return prompts


def run(engine: LLMEngine, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Closed loop: `concurrency` requests in flight until every prompt is done."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = engine.get_stats()
    pending, last_seen, gaps, num_tokens, num_steps = list(enumerate(prompts)), {}, [], 0, 0
    emitting: dict[str, int] = {}  # request -> steps that gave it tokens
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(last_seen) < concurrency:
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, params)
            last_seen[str(index)] = (None, 0)
        num_steps += 1
        for output in engine.step():
            now = time.perf_counter()
            seen_time, seen_tokens = last_seen[output.request_id]
            tokens = len(output.outputs[0].token_ids)
            if tokens > seen_tokens and seen_time is not None:
                gaps.append(now - seen_time)
            num_tokens += tokens - seen_tokens
            emitting[output.request_id] = emitting.get(output.request_id, 0) + (tokens > seen_tokens)
            last_seen[output.request_id] = (now, tokens)
            if output.finished:
                del last_seen[output.request_id]
    wall = time.perf_counter() - start
    after = engine.get_stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_pos_after = after.spec_num_accepted_tokens_per_pos or []
    per_pos_before = (before.spec_num_accepted_tokens_per_pos or []) + [0] * len(per_pos_after)
    gaps.sort()
    return {"tok_s": num_tokens / wall, "tokens": num_tokens, "wall_s": wall, "steps": num_steps,
            "emitting_steps_per_request": statistics.mean(emitting.values()) if emitting else None,
            "tokens_per_request": num_tokens / len(emitting) if emitting else None,
            "accept_len": 1 + accepted / drafts if drafts else None, "drafts": drafts,
            "draft_tokens": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            "per_pos": ([round((a - b) / drafts, 3) for a, b in zip(per_pos_after, per_pos_before, strict=False)]
                        if drafts else []),
            "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else None,
            "itl_p99_ms": 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None}


MEDUSA_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]"
"""A 9-node sparse tree over 4 Medusa heads (the shape of Medusa's mc_sim trees, cut small for a CPU)."""
TREES = {"eagle-tree": {"tree_top_k": 4, "tree_total_tokens": 12},
         "medusa-tree": {"speculative_token_tree": MEDUSA_TREE}}
"""Tree variants (--methods eagle-tree,medusa-tree): verified in one forward with a tree mask."""


def configs(methods: list[str], heads_dir: Path, k: int, heads: dict[str, str] | None = None,
            draft_model: str = "qwen2.5-coder-0.5b") -> dict[str, dict | None]:
    """methods: NAME[@HEADS][:K][:vN][:int8][:fixed] each; heads: method -> heads directory name under heads_dir
    (default smollm2-135m-<method>); @HEADS names another one for that configuration."""
    out: dict[str, dict | None] = {"off": None}
    for spec in methods:
        name, *options = spec.split(":")
        name, _, heads_name = name.partition("@")
        method = {"draft": "draft_model"}.get(name.removesuffix("-tree"), name.removesuffix("-tree"))
        config = {"method": method, "num_speculative_tokens": k, **TREES.get(name, {})}
        vocab = [o for o in options if o[:1] == "v" and o[1:].isdigit()]
        if vocab:
            config["draft_vocab_size"] = int(vocab[0][1:])
            options = [o for o in options if o not in vocab]
        if "int8" in options:
            config["quantization"] = "int8"
            options.remove("int8")
        if options and options[0] != "fixed":
            config["num_speculative_tokens"] = int(options.pop(0))
        if options == ["fixed"]:
            config["adaptive"] = False
        elif options:
            raise SystemExit(f"{spec!r}: a method is NAME[@HEADS][:K][:vN][:int8][:fixed]")
        if method == "draft_model":
            config["model"] = draft_model
        if method in ("eagle", "medusa"):
            config["model"] = str(heads_dir / (heads_name or (heads or {}).get(method, f"smollm2-135m-{method}")))
            if not Path(config["model"]).is_dir():
                print(f"skip {method}: no heads in {config['model']}")
                continue
        out[spec] = config
    return out


class TransformersPair:
    """transformers on the same pair: plain greedy `generate` and assisted generation with the draft,
    stopping at the engine's end-of-sequence ids (the converted config names only one of them)."""

    def __init__(self, target: str, draft: str, eos_token_ids: list[int]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from threefold.bench.peers import best_dtype, convert

        self.dtype, self.eos_token_ids = best_dtype("auto"), eos_token_ids
        load = lambda name: AutoModelForCausalLM.from_pretrained(  # noqa: E731
            convert(name), dtype=getattr(torch, self.dtype)).eval()
        self.target, self.draft = load(target), load(draft)

    def run(self, prompt_ids: list[list[int]], assisted: bool, max_tokens: int) -> dict:
        import torch

        num_tokens, start = 0, time.perf_counter()
        for ids in prompt_ids:
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = self.target.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                           do_sample=False, assistant_model=self.draft if assisted else None,
                                           eos_token_id=self.eos_token_ids, pad_token_id=self.eos_token_ids[0])
            num_tokens += out.shape[1] - len(ids)
        wall = time.perf_counter() - start
        return {"tok_s": num_tokens / wall, "tokens": num_tokens, "wall_s": wall, "steps": None,
                "emitting_steps_per_request": None, "tokens_per_request": num_tokens / len(prompt_ids),
                "accept_len": None, "drafts": 0, "draft_tokens": 0, "per_pos": [], "itl_p50_ms": None,
                "itl_p99_ms": None}


def vllm_cells(target: str, draft: str, k: int, prompt_ids: list[list[int]], max_tokens: int,
               rounds: int) -> list[dict]:
    """vLLM CPU plain and with `draft` drafting k tokens, through benchmarks/spec_vllm.py in the peer venv."""
    from threefold.bench.peers import best_dtype, convert, venv_python

    spec = {"model": str(convert(target)), "dtype": best_dtype("auto"), "prompt_ids": prompt_ids,
            "max_tokens": max_tokens, "rounds": rounds,
            "configs": {"vllm": None, "vllm-draft": {"method": "draft_model", "model": str(convert(draft)),
                                                     "num_speculative_tokens": k}}}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{len(os.sched_getaffinity(0)) - 1}",
               "VLLM_CPU_KVCACHE_SPACE": "1"}
        proc = subprocess.run([str(venv_python("vllm")), str(Path(__file__).with_name("spec_vllm.py")), f.name],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    lines = proc.stdout.splitlines()
    cells = [json.loads(line.removeprefix("RESULT ")) for line in lines if line.startswith("RESULT ")]
    if proc.returncode != 0 or not cells:
        print("\n".join(lines[-30:]))
        print(f"vLLM peer failed (exit {proc.returncode})")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="the target")
    parser.add_argument("--methods", default="ngram,eagle,medusa",
                        help="NAME[@HEADS][:K][:vN][:fixed], comma-separated")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b", help="the draft of the `draft` method")
    parser.add_argument("--heads-dir", type=Path, default=Path.home() / ".cache/threefold/heads")
    parser.add_argument("--eagle-heads", default="smollm2-135m-eagle", help="EAGLE head directory under --heads-dir")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--workloads", default="humaneval,sharegpt")
    parser.add_argument("--num-prompts", type=int, default=128, help="per workload")
    parser.add_argument("--batch1-prompts", type=int, default=6, help="batch 1 runs the first this many")
    parser.add_argument("--waves", type=int, default=4,
                        help="concurrency c > 1 runs c x waves prompts (at most --num-prompts), c in flight")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--peers", action="store_true",
                        help="add transformers plain and assisted generation (--model + --draft-model), batch 1")
    parser.add_argument("--vllm", action="store_true",
                        help="add vLLM CPU plain and with --draft-model (k = --k), batch 1, its own process")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes of KV per engine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    loaders = {"humaneval": lambda: humaneval_prompts(args.num_prompts),
               "sharegpt": lambda: sharegpt_prompts(loaded.tokenizer, args.num_prompts)}
    workloads = {name: loaders[name]() for name in args.workloads.split(",")}
    results = []
    for workload, prompts in workloads.items():  # first, while this process holds only the target's weights
        if args.vllm and "1" in args.concurrency.split(","):
            for result in vllm_cells(args.model, args.draft_model, args.k,
                                     [loaded.tokenizer.encode(p) for p in prompts[: args.batch1_prompts]],
                                     args.max_tokens, args.rounds):
                result.update(workload=workload, concurrency=1, num_prompts=args.batch1_prompts)
                results.append(result)
                print(json.dumps(result), flush=True)
    engines = {name: LLMEngine(loaded, EngineArgs(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                                                  max_model_len=2048,
                                                  enable_prefix_caching=False, speculative_config=config))
               for name, config in configs([m for m in args.methods.split(",") if m], args.heads_dir, args.k,
                                           {"eagle": args.eagle_heads}, args.draft_model).items()}
    peers = TransformersPair(args.model, args.draft_model, list(loaded.eos_token_ids)) if args.peers else None
    warmup = next(iter(workloads.values()))[:4]
    for engine in engines.values():  # first-call costs (weight packing, page faults) land outside every cell
        run(engine, warmup, len(warmup), 8)
    if peers:
        for assisted in (False, True):
            peers.run([loaded.tokenizer.encode(p) for p in warmup[:1]], assisted, 8)
    for workload, prompts in workloads.items():
        for concurrency in map(int, args.concurrency.split(",")):
            subset = prompts[: args.batch1_prompts] if concurrency == 1 else prompts[: concurrency * args.waves]
            cells = list(engines) + (["hf", "hf-assisted"] if peers and concurrency == 1 else [])
            for round_index in range(args.rounds):
                # Every other round runs the configurations in reverse, so each runs as often first as
                # last (the second engine of a process ran slower: BENCHMARKS "order effect").
                names = cells if round_index % 2 == 0 else cells[::-1]
                for name in names:
                    if name in engines:
                        result = run(engines[name], subset, concurrency, args.max_tokens)
                    else:
                        result = peers.run([loaded.tokenizer.encode(p) for p in subset],  # type: ignore[union-attr]
                                           name == "hf-assisted", args.max_tokens)
                    result.update(workload=workload, concurrency=concurrency, config=name, round=round_index,
                                  num_prompts=len(subset))
                    results.append(result)
                    print(json.dumps(result), flush=True)
    summary = summarize(results, peers.dtype if peers else None)
    print(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"cpu": str(cpu_info()), "machine": platform.machine(), "args": vars(args), "results": results}
        args.out.write_text(json.dumps(record, indent=1, default=str))


def summarize(results: list[dict], peer_dtype: str | None = None) -> str:
    """A markdown table: median over rounds, each config's tok/s as a ratio of off in the same cell
    (the peers' rows as a ratio of off too; hf-assisted also of hf, vllm-draft of vllm: their own plain)."""
    rows = [("| workload | conc | config | tok/s | x off | accept len | mean k | per pos | ITL p50 ms | ITL p99 ms "
             "| steps | steps emitting / request | tokens / request |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cells: dict[tuple, list[dict]] = {}
    for r in results:
        cells.setdefault((r["workload"], r["concurrency"], r["config"]), []).append(r)
    for (workload, conc, name), runs in cells.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        off = statistics.median(r["tok_s"] for r in cells[(workload, conc, "off")])
        last = runs[-1]
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        label = {"hf": f"transformers {peer_dtype}", "vllm": "vLLM CPU"}.get(name, name)
        if name in ("hf-assisted", "vllm-draft"):
            plain = statistics.median(r["tok_s"] for r in cells[(workload, conc, name.split("-")[0])])
            label = {"hf-assisted": f"transformers {peer_dtype} assisted", "vllm-draft": "vLLM CPU draft model"}[name]
            label += f" ({tok_s / plain:.2f}x plain)"
        mean_k = last["draft_tokens"] / last["drafts"] if last.get("drafts") else None
        rows.append(f"| {workload} | {conc} | {label} | {tok_s:.1f} | {tok_s / off:.2f} | {fmt(last['accept_len'])} "
                    f"| {fmt(mean_k)} | {last['per_pos']} | {fmt(last['itl_p50_ms'])} | {fmt(last['itl_p99_ms'])} "
                    f"| {last['steps']} | {fmt(last['emitting_steps_per_request'])} "
                    f"| {fmt(last['tokens_per_request'])} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
