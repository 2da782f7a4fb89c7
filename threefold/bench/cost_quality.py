"""What each rung of `bench cost` costs in quality.

KL and top-1 agreement (bench/quality.py's definitions) against the reference, threefold at
fp32 with no technique, on a fixed set of held-out ShareGPT sequences. Only the KV codec and
the compute dtype change the arithmetic of a forward pass, so the scores are computed once
per (dtype, codec) the ladder uses and shared by the rungs that run it; the candidate engine
prefills in chunks so later chunks read their context back through the codec. Whether the
other techniques leave the *outputs* unchanged is checked on the rungs' real outputs instead
(greedy: prefix caching, tiers, routing and speculation must all reproduce them).

HumanEval pass@1: each rung's greedy completions of the workload's HumanEval prompts, cut at
the usual stop sequences, run with the problem's tests in a subprocess: `python -I` in an
empty temporary directory, a wall-clock timeout, and limits on memory, CPU time and file size.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from threefold.bench.datasets import humaneval_path
from threefold.bench.quality import evaluate_quality, heldout_sequences

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""Where a completion's function body ends (Codex's HumanEval stop sequences)."""


class HFScorer:
    """score_distributions for a transformers model (the baseline's own arithmetic)."""

    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def score_distributions(self, token_id_lists: list[list[int]]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [torch.log_softmax(self.model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
                    for ids in token_id_lists]


def _engine(loaded, dtype: str, codec: str, seq_len: int, chunk: int):
    from threefold.engine.llm import LLM
    from threefold.engine.llm_engine import EngineArgs, LLMEngine

    args = EngineArgs(dtype=dtype, kv_cache_dtype=codec, block_size=32 if codec.startswith("kivi") else 16,
                      max_num_batched_tokens=chunk, kv_cache_memory=64 << 20, max_model_len=seq_len + 8,
                      enable_prefix_caching=False)
    return LLM.from_engine(LLMEngine(loaded, args))


def quality_table(model: str, dtype: str, codecs: list[str], hf_dir: str | None, num_sequences: int,
                  seq_len: int, chunk: int = 64, fp32_model=None) -> dict[str, dict]:
    """'auto' / each codec (threefold at `dtype`) and 'hf' (when hf_dir is given) -> QualityResult dict.
    `fp32_model`: the model already loaded at float32, if the caller has it (saves a load)."""
    from threefold.model.loader import load_model

    reference_model = fp32_model or load_model(model, dtype="float32", max_model_len=seq_len + 8)
    reference = _engine(reference_model, "float32", "auto", seq_len, chunk)
    sequences = heldout_sequences(reference.get_tokenizer(), num_sequences, seq_len)
    candidate_model = (reference_model if dtype == "float32"
                       else load_model(model, dtype=dtype, max_model_len=seq_len + 8))
    table = {}
    for codec in ["auto", *(c for c in codecs if c != "auto")]:
        candidate = _engine(candidate_model, dtype, codec, seq_len, chunk)
        table[codec] = evaluate_quality(candidate, reference, sequences).as_dict()
    if hf_dir is not None:
        table["hf"] = evaluate_quality(HFScorer(hf_dir), reference, sequences).as_dict()
    return table


def humaneval_problems() -> dict[str, dict]:
    with gzip.open(humaneval_path(), "rt") as f:
        return {p["task_id"]: p for p in map(json.loads, f) if p}


def truncate(completion: str) -> str:
    cut = min((i for stop in STOP_SEQUENCES if (i := completion.find(stop)) >= 0), default=len(completion))
    return completion[:cut]


_RUNNER = ("import resource, sys\n"
           "for limit, value in ((resource.RLIMIT_AS, 2 << 30), (resource.RLIMIT_CPU, int(sys.argv[1])),\n"
           "                     (resource.RLIMIT_FSIZE, 16 << 20)):\n"
           "    resource.setrlimit(limit, (value, value))\n"
           "exec(compile(open('program.py').read(), 'program.py', 'exec'), {'__name__': '__main__'})\n")
"""Sets the limits inside the child before the program runs (no preexec_fn: we have threads)."""


def passes(problem: dict, completion: str, timeout_s: float = 10.0) -> bool:
    """Does prompt + completion pass the problem's tests? (exit 0 within the limits)"""
    program = (problem["prompt"] + truncate(completion) + "\n\n" + problem["test"]
               + f"\n\ncheck({problem['entry_point']})\n")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "program.py").write_text(program)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER, str(int(timeout_s) + 1)], cwd=tmp, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            return proc.wait(timeout_s) == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the program and anything it started
            proc.wait()
            return False


def pass_at_1(completions: dict[str, str], problems: dict[str, dict], asked: int) -> dict:
    """Greedy pass@1 over the `asked` problems; a failed request counts as a failure."""
    passed = sorted(task for task, text in completions.items() if passes(problems[task], text))
    return {"pass_at_1": len(passed) / asked if asked else None, "passed": passed, "problems": asked}
