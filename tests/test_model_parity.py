"""threefold's forward vs Hugging Face transformers on the same weights.

Real weights: SmolLM2-135M-Instruct from its Q4_1 GGUF, both sides dequantizing
the same file to fp32. Tiny random checkpoints cover the architecture variants.
"""

from __future__ import annotations

import os
from itertools import pairwise

import pytest
import torch

from threefold.model.loader import load_model

from model_fixtures import (
    TINY_VARIANTS,
    DenseCacheAttention,
    dense_causal_attention,
    greedy,
    hf_reference_greedy,
    make_tiny_checkpoint,
    smollm2_gguf_path,
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13,",
]
NUM_TOKENS = 32
# Both sides compute in fp32 from identical dequantized weights; they differ only in
# op order (fused qkv/gate_up matmuls, SDPA vs eager softmax, rms_norm kernel), which
# moved logits by at most ~3e-5 (at |logit| ~36) when measured. 2e-3 on a logprob is
# ~50x that noise, while a real bug (q/k permutation, rope, a norm or bias) moves
# logprobs by > 0.1.
LOGPROB_ATOL = 2e-3
# Tiny random models: fp32, logits of order 1-10; same reasoning, smaller magnitudes.
TINY_LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a 2-core box shared with other jobs, two OpenMP threads
    spin-wait on each other and run these small matmuls ~20x slower (measured); one
    thread keeps the module's time predictable. Restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def smollm2_pair():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    ours = load_model(str(path), dtype="float32")
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return ours, theirs.eval()


def test_smollm2_config(smollm2_pair):
    ours, theirs = smollm2_pair
    config = ours.config
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads) == ("llama", 30, 9, 3)
    assert (config.vocab_size, config.hidden_size, config.head_dim) == (49152, 576, 64)
    assert config.tie_word_embeddings and config.dtype == torch.float32
    assert config.rope_theta == theirs.config.rope_parameters["rope_theta"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_greedy_matches_transformers(smollm2_pair, prompt):
    """Our greedy decode (prefill, then one token per step: the engine's hot path) vs
    transformers teacher-forced on our output in one forward. If transformers' argmax
    at every step equals our token, its own greedy decode would produce the same 32
    tokens (by induction), at half the cost of running its decode loop too."""
    ours, theirs = smollm2_pair
    prompt_ids = ours.tokenizer.encode(prompt)
    our_ids, our_logprobs = greedy(ours.model, prompt_ids, NUM_TOKENS)
    with torch.inference_mode():
        logits = theirs(torch.tensor([prompt_ids + our_ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)  # [NUM_TOKENS, vocab]
    their_ids = logp.argmax(-1).tolist()
    assert our_ids == their_ids, (ours.tokenizer.decode(our_ids), ours.tokenizer.decode(their_ids))
    their_logprobs = logp.gather(1, torch.tensor(our_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(our_logprobs), their_logprobs, atol=LOGPROB_ATOL, rtol=0)


def test_hf_reference_greedy_agrees(smollm2_pair):
    """The shared helper hf_reference_greedy (transformers' own KV-cache decode) gives
    the same tokens as ours on one prompt."""
    ours, theirs = smollm2_pair
    prompt_ids = ours.tokenizer.encode(PROMPTS[0])
    assert hf_reference_greedy(theirs, prompt_ids, 8)[0] == greedy(ours.model, prompt_ids, 8)[0]


def test_smollm2_batched_prefill_matches_single(smollm2_pair):
    """Two sequences flattened into one forward (positions restart per sequence) give
    the same last-token logits as running each alone: the forward has no cross-token
    state besides attention."""
    ours, _ = smollm2_pair
    seqs = [ours.tokenizer.encode(p) for p in PROMPTS[:2]]
    single = [ours.model.compute_logits(ours.model(torch.tensor(s), torch.arange(len(s)), dense_causal_attention))
              for s in seqs]
    bounds = [0, len(seqs[0]), len(seqs[0]) + len(seqs[1])]

    def varlen_attention(layer_idx, q, k, v):
        return torch.cat([dense_causal_attention(layer_idx, q[a:b], k[a:b], v[a:b])
                          for a, b in pairwise(bounds)])

    ids = torch.tensor(seqs[0] + seqs[1])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    batched = ours.model.compute_logits(ours.model(ids, positions, varlen_attention))
    torch.testing.assert_close(batched[: bounds[1]], single[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batched[bounds[1] :], single[1], atol=1e-4, rtol=1e-4)


def test_smollm2_bfloat16_agrees_with_fp32(smollm2_pair):
    """bf16 (the CPU default for quantized GGUF) keeps the greedy continuation of an
    easy prompt; bf16 rounding (~3 significant digits) allows no tighter check."""
    ours, _ = smollm2_pair
    bf16 = load_model(str(smollm2_gguf_path()), dtype="bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt_ids = ours.tokenizer.encode(PROMPTS[0])
    ids32, _ = greedy(ours.model, prompt_ids, 6)
    ids16, _ = greedy(bf16.model, prompt_ids, 6)
    assert ids16 == ids32


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_checkpoint(root / v, v) for v in TINY_VARIANTS if v != "fp16"}


@pytest.mark.parametrize("variant", [v for v in TINY_VARIANTS if v != "fp16"])
def test_tiny_variant_logits_match_transformers(tiny_dirs, variant):
    from transformers import AutoModelForCausalLM

    path = tiny_dirs[variant]
    ours = load_model(str(path), dtype="float32")
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = theirs(ids[None]).logits[0].float()  # [24, vocab]
        # Prefill 16 tokens, then decode 8 one at a time, so positions > 0 and the
        # cache path are exercised too.
        attention = DenseCacheAttention()
        chunks = [ours.model.compute_logits(ours.model(ids[:16], torch.arange(16), attention))]
        chunks += [ours.model.compute_logits(ours.model(ids[pos : pos + 1], torch.tensor([pos]), attention))
                   for pos in range(16, 24)]  # in order: each decode step reads the cache the last one wrote
    actual = torch.cat(chunks)
    assert expected.abs().max() > 1.0  # random weights big enough that a bug would show
    torch.testing.assert_close(actual, expected, atol=TINY_LOGIT_ATOL, rtol=1e-4)


@pytest.mark.skipif(os.environ.get("THREEFOLD_SLOW_TESTS") != "1", reason="slow (~1 min); set THREEFOLD_SLOW_TESTS=1")
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_gguf_matches_transformers(name):
    """qwen2 GGUF (q/k/v biases, no q/k permutation, untied head, K-quants): logits of a
    prompt plus 12 greedy tokens match transformers; measured max |diff| ~2e-5."""
    from transformers import AutoModelForCausalLM

    from threefold.model.registry import REGISTRY, is_pulled, resolve

    if not is_pulled(REGISTRY[name]):
        pytest.skip(f"{name} not pulled (threefold pull {name})")
    path = resolve(name)
    ours = load_model(name, dtype="float32")
    prompt_ids = ours.tokenizer.encode("def quicksort(arr):\n")
    our_ids, _ = greedy(ours.model, prompt_ids, 12)
    ids = torch.tensor(prompt_ids + our_ids)
    with torch.inference_mode():
        actual = ours.model.compute_logits(ours.model(ids, torch.arange(len(ids)), dense_causal_attention))
    del ours
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        expected = theirs(ids[None]).logits[0].float()
    torch.testing.assert_close(actual, expected, atol=1e-3, rtol=0)
