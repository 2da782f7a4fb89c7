"""`threefold bench quality`: what a configuration costs in model quality.

On held-out ShareGPT text (the `test` split) we score every next-token
distribution twice: with the candidate configuration (e.g. bf16, int4 KV,
speculation) and with a reference of the same model (fp32, no compression, no
speculation). Over all scored positions t (token-weighted):

    ppl        = exp(mean_t -log q_t(x_{t+1}))           candidate perplexity
    kl_mean    = mean_t sum_v p_t(v) (log p_t(v) - log q_t(v))   KL(reference || candidate)
    top1_agreement = mean_t [argmax q_t == argmax p_t]

p is the reference, q the candidate. Both come from the engine hook
`llm.score_distributions(token_id_lists) -> list[Tensor[len-1, vocab]]`
(float32 log-probs; row t predicts token t+1). Everything is deterministic:
the sequences are fixed by the seed and the scoring is greedy-free.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from threefold.bench.sharegpt import dialogue, open_sharegpt
from threefold.errors import ThreefoldError


class Scorer(Protocol):
    def score_distributions(self, token_id_lists: list[list[int]]) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class QualityResult:
    ppl: float
    """Candidate perplexity on the scored tokens."""
    kl_mean: float
    """Mean KL(reference || candidate) per position, nats."""
    top1_agreement: float
    """Fraction of positions where both configurations' most likely token is the same."""
    reference_ppl: float
    num_tokens: int
    """Positions scored (sum of len-1 over sequences)."""
    num_sequences: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Totals:
    nll: float = 0.0
    ref_nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    tokens: int = 0

    def add(self, cand: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> None:
        """cand, ref: [len-1, vocab] log-probs; targets: [len-1] the tokens that followed."""
        cand, ref = cand.float(), ref.float()
        self.nll -= cand.gather(1, targets[:, None]).sum().item()
        self.ref_nll -= ref.gather(1, targets[:, None]).sum().item()
        p = ref.exp()
        # 0 * log 0 = 0: vocabulary rows the reference rules out contribute nothing.
        diff = torch.where(p > 0, ref - cand, torch.zeros_like(ref))
        self.kl += (p * diff).sum().item()
        self.agree += int((cand.argmax(-1) == ref.argmax(-1)).sum().item())
        self.tokens += len(targets)


def _scores(llm: Scorer, batch: list[list[int]]) -> list[torch.Tensor]:
    if not hasattr(llm, "score_distributions"):
        raise ThreefoldError("this engine has no score_distributions(token_id_lists); bench quality needs it")
    scores = llm.score_distributions(batch)
    for ids, s in zip(batch, scores):
        if s.shape[0] != len(ids) - 1:
            raise ThreefoldError(f"score_distributions returned {s.shape[0]} rows for {len(ids)} tokens; "
                                 f"expected {len(ids) - 1} (row t predicts token t+1)")
    return scores


def evaluate_quality(candidate_llm: Scorer, reference_llm: Scorer, token_id_lists: list[list[int]],
                     batch_size: int = 4) -> QualityResult:
    """Perplexity, KL to the reference and top-1 agreement over `token_id_lists` (each 2+ tokens)."""
    if not token_id_lists or any(len(ids) < 2 for ids in token_id_lists):
        raise ThreefoldError("quality needs sequences of at least 2 tokens", param="token_id_lists")
    totals = _Totals()
    for start in range(0, len(token_id_lists), batch_size):
        batch = token_id_lists[start:start + batch_size]
        cands, refs = _scores(candidate_llm, batch), _scores(reference_llm, batch)
        for ids, cand, ref in zip(batch, cands, refs):
            totals.add(cand, ref, torch.tensor(ids[1:], dtype=torch.long))
    n = totals.tokens
    return QualityResult(ppl=math.exp(totals.nll / n), kl_mean=totals.kl / n, top1_agreement=totals.agree / n,
                         reference_ppl=math.exp(totals.ref_nll / n), num_tokens=n,
                         num_sequences=len(token_id_lists))


def heldout_sequences(tokenizer, num: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """`num` token sequences of exactly `seq_len` tokens: whole ShareGPT conversations of the
    test split (user and assistant turns joined by blank lines), in a seed-determined order."""
    sequences = []
    for record in open_sharegpt().iter_records("test", seed):
        pairs = dialogue(record)
        text = "\n\n".join(part for pair in pairs for part in pair)
        if len(text) < seq_len:  # cheaper than tokenizing: fewer characters than tokens needed
            continue
        ids = tokenizer.encode(text[: seq_len * 8])
        if len(ids) >= seq_len:
            sequences.append(ids[:seq_len])
            if len(sequences) == num:
                return sequences
    raise ThreefoldError(f"only {len(sequences)} held-out conversations reach {seq_len} tokens", param="seq_len")


def reference_args(candidate_args):
    """The reference configuration: same model and context, fp32, every other knob at its
    default (defaults are: no KV compression, no speculation)."""
    from threefold.engine.llm_engine import EngineArgs

    return EngineArgs(model=candidate_args.model, dtype="float32", max_model_len=candidate_args.max_model_len,
                      seed=candidate_args.seed)


def quality_main(ns) -> int:
    import json
    import time

    from threefold.bench.report import cpu_record
    from threefold.cli import engine_args_from
    from threefold.engine.llm import LLM

    start = time.perf_counter()
    cand_args = engine_args_from(ns)
    candidate = LLM.from_engine_args(cand_args)
    reference = LLM.from_engine_args(reference_args(cand_args))
    sequences = heldout_sequences(candidate.get_tokenizer(), ns.num_sequences, ns.seq_len, ns.seed)
    result = evaluate_quality(candidate, reference, sequences, ns.batch_size)
    doc = {"kind": "quality", "label": ns.label or ns.model, "config": {k: v for k, v in vars(ns).items()
                                                                      if not callable(v)},
           "result": result.as_dict(), "seconds": time.perf_counter() - start, "cpu": cpu_record()}
    print(f"ppl {result.ppl:.4f} (reference {result.reference_ppl:.4f})  KL {result.kl_mean:.6f} nats  "
          f"top-1 agreement {result.top1_agreement:.4%}  over {result.num_tokens} tokens")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0
