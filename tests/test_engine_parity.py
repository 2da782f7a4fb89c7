"""The whole engine (paged KV, batching, chunked prefill, sampler) vs Hugging Face transformers.

SmolLM2-135M-Instruct from its real GGUF; transformers dequantizes the same file.
The model-level test (test_model_parity) checks the forward alone; this one checks
what users get from LLM.generate, with all prompts batched together.
"""

from __future__ import annotations

import pytest
import torch

from threefold.sample.params import SamplingParams

from model_fixtures import hf_reference_greedy, smollm2_gguf_path

PROMPTS = [
    "The capital of France is",
    "def quicksort(items):\n    ",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at 100 degrees Celsius because",
]
NUM_TOKENS = 32
# Same justification as test_model_parity: fp32 on identical weights differs only in op
# order (~3e-5 on logits); paged attention and chunked prefill add reductions in another
# order but no approximation. 2e-3 is far below what any real bug moves (> 0.1).
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module")
def hf_reference():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("budget", [512, 6])
def test_generate_matches_transformers(make_llm, hf_reference, budget):
    llm = make_llm(max_num_batched_tokens=budget)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids, logprobs = hf_reference_greedy(hf_reference, tokenizer.encode(prompt), NUM_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == ids, prompt
        ours = [position[t].logprob for t, position in zip(completion.token_ids, completion.logprobs, strict=True)]
        assert ours == pytest.approx(logprobs, abs=LOGPROB_ATOL), prompt
