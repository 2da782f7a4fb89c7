"""KV-cache codecs side by side: memory, quality through the compressed cache, decode attention time.

    flock /tmp/threefold-bench.lock python benchmarks/kv_codecs.py [--codecs auto,int8,...] [--skip-quality]
    python benchmarks/kv_codecs.py --skip-speed      # memory and quality: no timing, no lock

Memory: bytes per token (everything a block stores, all layers) and tokens in 256 MiB, for
the model's KV geometry. Quality: ShareGPT test-split conversations concatenated into
contexts of >= 1024 tokens, scored position by position with prefill chunks of 64 tokens,
so every chunk after the first reads its context back from the compressed cache; ppl, KL
against `auto` and top-1 agreement over all positions. Fidelity: the model's real K/V of the
first context round-tripped through each codec, attention recomputed (cosines, top-1 key).
Speed: one layer's decode attention (native kernels, KIVI's, GEAR's and TurboQuant's too) per token
at 1k and 4k contexts (--speed-lengths), batch 4, against `auto` (TurboQuant without a window also
through its plain-torch reference path: `reference_*`).
Prefill (--prefill, under the lock): one prompt of --prompt-tokens concatenated test-split conversations
in one chunk, timed end to end (LLM.generate, 1 output token; best and median of --repeats), per codec,
and for KIVI / tiered also through the previous path (blocks encoded in torch, chunks through the decode
kernel row by row: KiviAttention.tiled_prefill = False), against `auto`.
Throughput (--throughput, under the lock): offline ShareGPT first turns through LLM.generate
at a small KV budget (--budget, 64 MiB), per codec: output tok/s and the most sequences that
ran at once, against `auto` (--long-prompts: every prompt --prompt-tokens long, concatenated
conversations, for the context lengths where KIVI's window is amortized; --vllm-peer auto,fp8:
vLLM CPU on the same prompts at the same KV bytes, `kv_cache_memory_bytes`, in its peer venv).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import time

import torch

from threefold.bench.sharegpt import dialogue, open_sharegpt
from threefold.cpu import cpu_info
from threefold.engine.llm import LLM
from threefold.kernels import cpu_kernels
from threefold.kv.capacity import mix_geometry
from threefold.kv.mix import is_mix, parse_mix
from threefold.kv.native import _reference_decode, decode_attention
from threefold.kv.registry import make_codec
from threefold.kv.spec import parse_kv_spec, split_spec_list

DEFAULT_CODECS = "auto,int8,fp8,fp8_e5m2,int4,kivi2,kivi4,gear,turboquant"


def block_size_for(spec: str) -> int:
    """16, or KIVI's group (its blocks hold whole key groups; a mix: every KIVI layer's)."""
    specs = set(parse_mix(spec)) if is_mix(spec) else {parse_kv_spec(spec)}
    groups = [getattr(make_codec(s, 1, 128, torch.float32), "group", 16) for s in specs]
    return max(16, *groups)


def memory_rows(config, codecs: list[str], dtype: torch.dtype) -> list[dict]:
    """Bytes per token with everything counted: blocks, plus (KIVI) one request's full-precision
    window amortized over a 1k or 4k context. A per-layer mix counts each layer's codec."""
    rows = []
    for spec in codecs:
        block_size, block_bytes, window = mix_geometry(dataclasses.replace(config, dtype=dtype), spec,
                                                       block_size_for(spec))
        per_token = block_bytes / block_size
        rows.append({"codec": spec, "block_bytes_per_token": per_token,
                     "window_bytes_per_seq": window,
                     "bytes_per_token_1k": per_token + window / 1024, "bytes_per_token_4k": per_token + window / 4096,
                     "tokens_in_256MiB_at_4k": int((256 << 20) // (per_token + window / 4096))})
    return rows


def contexts(tokenizer, num: int, min_tokens: int) -> list[list[int]]:
    """Test-split ShareGPT conversations, concatenated until each context has min_tokens."""
    out, current = [], []
    for record in open_sharegpt().iter_records("test", seed=0):
        for user, assistant in dialogue(record):
            current += tokenizer.encode(f"User: {user}\nAssistant: {assistant}\n")
        if len(current) >= min_tokens:
            out.append(current[:min_tokens])
            current = []
            if len(out) == num:
                return out
    return out


def quality_rows(loaded, codecs: list[str], seqs: list[list[int]], chunk: int) -> list[dict]:
    from threefold.engine.llm_engine import EngineArgs, LLMEngine

    def score(spec):
        args = EngineArgs(dtype="float32", kv_cache_dtype=spec, max_num_batched_tokens=chunk,
                          block_size=block_size_for(spec),
                          kv_cache_memory=256 << 20, max_model_len=len(seqs[0]) + 8)
        return LLM.from_engine(LLMEngine(loaded, args)).score_distributions(seqs)

    reference = score("auto")
    rows = []
    for spec in codecs:
        cand = reference if spec == "auto" else score(spec)
        nll = kl = agree = count = 0.0
        for ids, p, q in zip(seqs, reference, cand, strict=True):  # one distribution per sequence
            targets = torch.tensor(ids[1:])
            nll += -q.gather(1, targets[:, None]).sum().item()
            kl += (p.exp() * (p - q)).sum().item()
            agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
            count += len(targets)
        rows.append({"codec": spec, "ppl": math.exp(nll / count), "kl_vs_auto": kl / count,
                     "top1_agreement": agree / count, "positions": int(count)})
        print(json.dumps(rows[-1]), flush=True)  # as it goes: a later codec's failure keeps these
    return rows


def fidelity_rows(loaded, codecs: list[str], ids: list[int], skip: int = 256) -> list[dict]:
    """Real K/V/Q of one causal forward over `ids`; per codec, every layer's K/V round-tripped whole
    (windowed codecs: every full block compressed, no window) and attention recomputed. Means over
    layers, query rows >= `skip` (most of their keys compressed), heads: cosine of K and V rows to
    the exact ones, cosine of attention outputs, and how often the most-attended key is the same."""
    import torch.nn.functional as F

    captured = []

    def attention(layer_idx, q, k, v):
        captured.append((q, k, v))
        return causal(q, k, v)[0]

    def causal(q, k, v):  # [T, H or kvh, d] -> output [T, H, d], weights [H, T, T]
        group = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
        scores = q.transpose(0, 1) @ keys.transpose(1, 2) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
        weights = scores.softmax(-1)
        return (weights @ values).transpose(0, 1), weights

    with torch.inference_mode():
        loaded.model(torch.tensor(ids), torch.arange(len(ids)), attention)
    config, rows = loaded.config, []
    for spec in codecs:
        codec = make_codec(spec, config.num_kv_heads, config.head_dim, torch.float32)
        sums = {"k_cosine": 0.0, "v_cosine": 0.0, "attn_out_cosine": 0.0, "top1_key_agreement": 0.0}
        try:
            codec.round_trip(*captured[0][1:])
        except TypeError as e:  # tiered: a token's codes depend on its age, not on the tensor alone
            rows.append({"codec": str(codec.spec), "skipped": str(e)})
            continue
        for q, k, v in captured:
            k_hat, v_hat = codec.round_trip(k, v)
            (out, weights), (out_hat, weights_hat) = causal(q, k, v), causal(q, k_hat, v_hat)
            sums["k_cosine"] += F.cosine_similarity(k_hat[skip:], k[skip:], dim=-1).mean().item()
            sums["v_cosine"] += F.cosine_similarity(v_hat[skip:], v[skip:], dim=-1).mean().item()
            sums["attn_out_cosine"] += F.cosine_similarity(out_hat[skip:], out[skip:], dim=-1).mean().item()
            top1 = weights[:, skip:].argmax(-1) == weights_hat[:, skip:].argmax(-1)
            sums["top1_key_agreement"] += top1.float().mean().item()
        rows.append({"codec": str(codec.spec), **{key: total / len(captured) for key, total in sums.items()}})
    return rows


def speed_rows(config, codecs: list[str], dtype: torch.dtype, lengths=(1024, 4096), batch=4,
               repeats=20) -> list[dict]:
    kernels = cpu_kernels()
    rows = []
    block_size, heads, kvh, d = 16, config.num_heads, config.num_kv_heads, config.head_dim
    for length in lengths:
        blocks_per_seq = length // block_size
        num_blocks = batch * blocks_per_seq + 1
        tables = torch.arange(1, num_blocks).view(batch, blocks_per_seq).contiguous()
        lens = torch.full((batch,), length, dtype=torch.long)
        q = torch.randn(batch, heads, d).to(dtype)
        out = torch.empty_like(q)
        timings, steps, references = {}, {}, {}
        for spec in codecs:
            codec = make_codec(spec, kvh, d, dtype)
            if codec.window_tokens(block_size_for(spec)):
                timings[spec], steps[spec] = kivi_decode_time(codec, config, length, batch, dtype, repeats)
                continue
            storage = codec.allocate(num_blocks, block_size, torch.device("cpu"))
            slots = torch.arange(num_blocks * block_size)
            codec.write(storage, slots, torch.randn(len(slots), kvh, d), torch.randn(len(slots), kvh, d))
            layout = codec.layout(storage)
            timings[spec] = best_time(
                functools.partial(decode_attention, kernels, out, q, layout, tables, lens, d ** -0.5, 0), repeats)
            if layout.kind == "turboquant":  # the path it took before its kernel: the codec's dense read + SDPA
                references[spec] = best_time(functools.partial(
                    _reference_decode, out, q, layout.read, tables, lens, d ** -0.5, 0), max(1, repeats // 4))
            del storage, layout
        rows.extend({"codec": spec, "context": length, "us_per_token_per_layer": timings[spec] / batch * 1e6,
                     "vs_auto": timings[spec] / timings["auto"],
                     **({"step_us_per_token_per_layer": steps[spec] / batch * 1e6,
                         "step_vs_auto": steps[spec] / timings["auto"]} if spec in steps else {}),
                     **({"reference_us_per_token_per_layer": references[spec] / batch * 1e6,
                         "reference_vs_auto": references[spec] / timings["auto"]} if spec in references else {})}
                    for spec in codecs)
    return rows


def kivi_decode_time(codec, config, length: int, batch: int, dtype: torch.dtype,
                     repeats: int) -> tuple[float, float]:
    """One layer's decode attention over KIVI blocks + windows (the native kernel where it runs: kivi2,
    kivi4, tiered, gear, turboquant; the context is written, not attended): the kernel call alone, like the
    dense rows, and the whole KiviAttention step (the ring writes and per-step Python around it)."""
    from threefold.kv.paged import PagedKVCache
    from threefold.kv.window import ArenaShape, WindowArena, window_dtype
    from threefold.worker.kivi_attention import NATIVE_KINDS, KiviAttention, KiviRequest

    block_size, kvh, d = getattr(codec, "group", 16), config.num_kv_heads, config.head_dim  # turboquant: 16
    per_seq = length // block_size + 1
    cache = PagedKVCache(codec, 1, batch * per_seq + 1, block_size, torch.device("cpu"))
    arena = WindowArena(ArenaShape.of([codec], block_size), batch, kvh, d, window_dtype(dtype), torch.device("cpu"))
    requests = []
    for b in range(batch):
        ids = torch.arange(1 + b * per_seq, 1 + (b + 1) * per_seq)
        window = arena.acquire(str(b), 0)
        # the context ends one token short of a block: each timed step decodes a token that completes
        # no block (31 of 32 decodes do; the 32nd also encodes a block)
        request = KiviRequest(0, length - 2, 0, ids, window)  # written (blocks, ring), not attended
        KiviAttention(cache, arena, [request], d ** -0.5, codec.residual)._write(
            0, codec, codec.residual, request, torch.randn(length - 2, kvh, d).to(dtype),
            torch.randn(length - 2, kvh, d).to(dtype))
        window.filled = length - 2
        requests.append(KiviRequest(b, 1, length - 2, ids, window))
    step = KiviAttention(cache, arena, requests, d ** -0.5, codec.residual, kernels=cpu_kernels())
    q, k, v = (torch.randn(batch, n, d).to(dtype) for n in (config.num_heads, kvh, kvh))
    step(0, q, k, v)
    layout, out = cache.layout(0), torch.empty_like(q)
    whole = best_time(lambda: step(0, q, k, v), repeats)  # the step rewrites one position: the same work each call
    if step.kernels is None or layout.kind not in NATIVE_KINDS:
        return whole, whole
    _, tables, meta, *tier = step._decode_args(codec.residual, codec if layout.kind == "tiered" else None)
    extra = (arena.band[0], arena.sinks[0], *tier) if tier else ()
    kernel = functools.partial(step._kernel, layout, out, q, step._ring(0), tables, meta, *extra)
    return best_time(kernel, repeats), whole


def best_time(call, repeats: int) -> float:
    """Seconds per call, the best of 3 rounds (the machine is shared)."""
    call()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def throughput_prompts(tokenizer, num_prompts: int, prompt_tokens: int, long: bool) -> list[dict]:
    """ShareGPT test-split first turns cut at prompt_tokens, or (long) contexts of exactly prompt_tokens."""
    if long:
        return [{"prompt_token_ids": ids} for ids in contexts(tokenizer, num_prompts, prompt_tokens)]
    prompts = []
    for record in open_sharegpt().iter_records("test", seed=0):
        turns = list(dialogue(record))
        if turns:
            prompts.append({"prompt_token_ids": tokenizer.encode(turns[0][0])[:prompt_tokens]})
        if len(prompts) == num_prompts:
            break
    return prompts


def throughput_rows(model: str, codecs: list[str], budget: int, num_prompts: int, prompt_tokens: int,
                    output_tokens: int, long: bool = False) -> list[dict]:
    """Offline generation of ShareGPT test-split first turns (truncated to prompt_tokens, exactly
    output_tokens each) at a `budget`-byte KV pool: output tok/s and peak running sequences.
    long: every prompt is exactly prompt_tokens of concatenated test-split conversations (`contexts`),
    so the requests are as long as the context length under test."""
    from threefold.sample.params import SamplingParams

    rows = []
    for spec in codecs:
        llm = LLM(model, dtype="auto", kv_cache_dtype=spec, kv_cache_memory=budget, block_size=block_size_for(spec),
                  max_model_len=prompt_tokens + output_tokens, max_num_seqs=256, enable_prefix_caching=False)
        prompts = throughput_prompts(llm.engine.core.loaded.tokenizer, num_prompts, prompt_tokens, long)
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        core = llm.engine.core
        llm.generate(prompts[:1], params)  # warm-up
        peak = count_peak_running(core)
        peak[0] = 0
        start = time.perf_counter()
        llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        info = core.cache_info
        prompt_total = sum(len(p["prompt_token_ids"]) for p in prompts)
        outputs = len(prompts) * output_tokens
        rows.append({"codec": spec, "budget_mib": budget / 2**20, "output_tok_s": outputs / elapsed,
                     "total_tok_s": (prompt_total + outputs) / elapsed,
                     "prompt_tokens_mean": prompt_total / len(prompts), "elapsed_s": elapsed,
                     "peak_running": peak[0], "capacity_tokens": info["capacity_tokens"],
                     "max_num_seqs": info["max_num_seqs"], "load_avg": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        row["tok_s_vs_auto"] = row["output_tok_s"] / rows[0]["output_tok_s"]
        row["total_vs_auto"] = row["total_tok_s"] / rows[0]["total_tok_s"]
        row["peak_vs_auto"] = row["peak_running"] / max(1, rows[0]["peak_running"])
    return rows


def prefill_rows(model: str, codecs: list[str], prompt_tokens: int, repeats: int) -> list[dict]:
    """One prompt of prompt_tokens in one chunk, timed end to end per codec (and per path for KIVI and
    tiered: the tiled kernels, then the previous path); the first codec is the ratios' baseline."""
    from threefold.sample.params import SamplingParams
    from threefold.worker.kivi_attention import KiviAttention

    rows: list[dict] = []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for spec in codecs:
        llm = LLM(model, dtype="auto", kv_cache_dtype=spec, kv_cache_memory=256 << 20,
                  block_size=block_size_for(spec), max_model_len=prompt_tokens + 8,
                  max_num_batched_tokens=prompt_tokens, enable_prefix_caching=False)
        prompt = [{"prompt_token_ids": contexts(llm.engine.core.loaded.tokenizer, 1, prompt_tokens)[0]}]
        windowed = any(layout.kind in ("kivi", "tiered") for layout in llm.engine.core.runner.kv_cache.layouts)
        for tiled in ([True, False] if windowed else [True]):
            KiviAttention.tiled_prefill = tiled
            llm.generate(prompt, params)  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                llm.generate(prompt, params)
                times.append(time.perf_counter() - start)
            rows.append({"codec": spec, "path": ("tiled" if tiled else "previous") if windowed else "",
                         "prompt_tokens": prompt_tokens, "best_s": min(times),
                         "median_s": sorted(times)[len(times) // 2], "load_avg": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), flush=True)
        KiviAttention.tiled_prefill = True
    for row in rows:
        row["best_vs_auto"] = row["best_s"] / rows[0]["best_s"]
    return rows


def vllm_rows(model: str, kv_dtypes: list[str], budget: int, prompts: list[dict], output_tokens: int,
              baseline: dict) -> list[dict]:
    """vLLM CPU (its peer venv) on the same prompts at the same KV bytes, per kv_cache_dtype (auto, fp8):
    output tok/s, and the ratio to threefold's first codec (`baseline`)."""
    from threefold.bench.offline import run_vllm

    requests = [{"prompt_token_ids": p["prompt_token_ids"], "max_tokens": output_tokens} for p in prompts]
    max_len = max(len(r["prompt_token_ids"]) for r in requests) + output_tokens
    rows = []
    for kv_dtype in kv_dtypes:
        elapsed = run_vllm(model, requests, "bfloat16", max_len, kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=budget,
                           max_num_seqs=256, enable_prefix_caching=False)
        outputs = len(requests) * output_tokens
        prompt_total = sum(len(r["prompt_token_ids"]) for r in requests)
        rows.append({"codec": f"vllm:{kv_dtype}", "budget_mib": budget / 2**20, "output_tok_s": outputs / elapsed,
                     "total_tok_s": (prompt_total + outputs) / elapsed, "elapsed_s": elapsed,
                     "load_avg": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        row["tok_s_vs_auto"] = row["output_tok_s"] / baseline["output_tok_s"]
        row["total_vs_auto"] = row["total_tok_s"] / baseline["total_tok_s"]
    return rows


def count_peak_running(core) -> list[int]:
    """[peak]: the most requests the scheduler ran at once, updated at every core step from now on."""
    peak, step = [0], core.step

    def counted_step(*args, **kwargs):
        out = step(*args, **kwargs)
        peak[0] = max(peak[0], len(core.scheduler.running))
        return out

    core.step = counted_step
    return peak


def guard_mixes(loaded, guard: str, budgets: list[float], num_tokens: int) -> tuple[list[str], list[dict]]:
    """Calibrate `guard` at each budget (ShareGPT train split, as the engine does at startup);
    the chosen mixes then go through memory and quality like any codec (test split)."""
    from threefold.config import CacheConfig
    from threefold.engine.kv_guard import resolve_guard

    mixes, rows = [], []
    for budget in budgets:
        cache = CacheConfig(block_size=block_size_for(guard.removeprefix("guard:").split(">")[0]),
                            kv_cache_dtype=guard, kv_quality_budget=budget)
        resolved, result = resolve_guard(loaded, cache, loaded.max_model_len, num_tokens)
        mixes.append(resolved.kv_cache_dtype)
        rows.append(dataclasses.asdict(result))
    return mixes, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--codecs", default=DEFAULT_CODECS)
    parser.add_argument("--contexts", type=int, default=2)
    parser.add_argument("--context-tokens", type=int, default=1088)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true", help="memory and quality only (no timing: no lock)")
    parser.add_argument("--skip-fidelity", action="store_true")
    parser.add_argument("--speed-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--speed-lengths", default="1024,4096", help="decode attention contexts, comma-separated")
    parser.add_argument("--throughput", action="store_true", help="offline ShareGPT throughput at --budget (only)")
    parser.add_argument("--prefill", action="store_true", help="one --prompt-tokens prompt's prefill time (only)")
    parser.add_argument("--repeats", type=int, default=3, help="--prefill: timed runs per codec and path")
    parser.add_argument("--budget", type=int, default=64 << 20, help="--throughput: KV bytes")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--long-prompts", action="store_true",
                        help="--throughput: prompts of exactly --prompt-tokens (concatenated conversations)")
    parser.add_argument("--vllm-peer", default="", help="--throughput: vLLM CPU kv_cache_dtypes to run on the same "
                                                         "prompts and KV bytes, comma-separated (e.g. auto,fp8)")
    parser.add_argument("--guard", default=None, help="e.g. guard:kivi2: calibrate it and add its mixes as rows")
    parser.add_argument("--guard-budgets", default="0.01", help="KL budgets (nats/token) for --guard, comma-separated")
    parser.add_argument("--guard-tokens", type=int, default=512, help="calibration tokens (the engine's default: 512)")
    ns = parser.parse_args()
    from threefold.model.loader import load_model

    codecs = split_spec_list(ns.codecs)
    if ns.prefill:  # codecs[0] is the baseline of the ratios
        rows = prefill_rows(ns.model, codecs, ns.prompt_tokens, ns.repeats)
        print(json.dumps({"cpu": cpu_info().describe(), "prefill": rows}, indent=1), flush=True)
        return
    if ns.throughput:  # codecs[0] is the baseline of the ratios
        result = {"cpu": cpu_info().describe(), "throughput": throughput_rows(
            ns.model, codecs, ns.budget, ns.num_prompts, ns.prompt_tokens, ns.output_tokens, ns.long_prompts)}
        if ns.vllm_peer:
            from threefold.bench.tokenizer import load_tokenizer

            prompts = throughput_prompts(load_tokenizer(ns.model), ns.num_prompts, ns.prompt_tokens, ns.long_prompts)
            result["vllm"] = vllm_rows(ns.model, ns.vllm_peer.split(","), ns.budget, prompts, ns.output_tokens,
                                       result["throughput"][0])
        print(json.dumps(result, indent=1), flush=True)
        return
    loaded = load_model(ns.model, dtype="float32")
    result: dict = {"cpu": cpu_info().describe(), "machine": platform.machine(), "model": ns.model}
    if ns.guard:
        budgets = [float(b) for b in ns.guard_budgets.split(",")]
        mixes, result["guard"] = guard_mixes(loaded, ns.guard, budgets, ns.guard_tokens)
        print(json.dumps(result["guard"], indent=1), flush=True)
        codecs += mixes
    result |= {
              "memory_bf16": memory_rows(loaded.config, codecs, torch.bfloat16),
              "memory_fp32": memory_rows(loaded.config, codecs, torch.float32)}
    print(json.dumps({k: result[k] for k in ("memory_bf16", "memory_fp32")}, indent=1, default=str), flush=True)
    if not ns.skip_speed:
        plain = [c for c in codecs if not is_mix(c)]  # a mix's speed is its layers' (per-codec rows)
        lengths = tuple(int(n) for n in ns.speed_lengths.split(","))
        result["speed"] = speed_rows(loaded.config, plain, getattr(torch, ns.speed_dtype), lengths)
        print(json.dumps(result["speed"], indent=1), flush=True)
    seqs = contexts(loaded.tokenizer, ns.contexts, ns.context_tokens)
    if not ns.skip_fidelity:
        result["fidelity"] = fidelity_rows(loaded, codecs, seqs[0])
        print(json.dumps(result["fidelity"], indent=1), flush=True)
    if not ns.skip_quality:
        result["quality"] = quality_rows(loaded, codecs, seqs, ns.chunk)
        print(json.dumps(result["quality"], indent=1), flush=True)


if __name__ == "__main__":
    main()
