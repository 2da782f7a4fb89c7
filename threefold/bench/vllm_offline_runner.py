"""Offline throughput of vLLM's `LLM.generate`, run inside the vLLM peer venv.

Executed by path with the peer's python (it must not import threefold, whose
dependencies that venv does not have):

    $THREEFOLD_HOME/peers/vllm/bin/python vllm_offline_runner.py SPEC.json

SPEC.json: {"model_dir", "dtype", "max_model_len", "requests": [{"prompt_token_ids", "max_tokens"}],
"engine_args": {...} (optional: more `vllm.LLM` keywords, e.g. kv_cache_dtype, kv_cache_memory_bytes)}.
Prints one line `RESULT {json}`. The __main__ guard is required: vLLM spawns
its engine process, which re-imports this file.
"""

import json
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              **spec.get("engine_args", {}))
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in spec["requests"]]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in spec["requests"]]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up, not timed
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print("RESULT " + json.dumps({"elapsed_s": elapsed,
                                  "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}), flush=True)


if __name__ == "__main__":
    main()
