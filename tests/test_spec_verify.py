"""verify_chains against the plain Sampler: the same greedy tokens (penalties included) and,
at T > 0 with top-k/top-p/min-p, the same distribution at every position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from threefold.kernels import cpu_kernels
from threefold.sample.metadata import SamplingMetadata, TokenCounts
from threefold.sample.params import SamplingParams
from threefold.sample.sampler import Sampler
from threefold.spec.verify import raw_argmax_decides, verify_chains

VOCAB = 8


def sequential_greedy(logits_rows, params, prompt, output, drafts):
    """The plain Sampler one row at a time, feeding back what it emitted (the oracle)."""
    emitted = []
    for j in range(len(drafts) + 1):
        counts = TokenCounts.for_params(params, prompt, output + emitted, VOCAB, "cpu")
        meta = SamplingMetadata.build([params], [len(output) + len(emitted)], [counts], {}, [0], VOCAB, "cpu")
        token = int(Sampler()(logits_rows[j : j + 1], meta).sampled_token_ids[0])
        emitted.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return emitted


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, min_tokens=3),
])
def test_greedy_is_the_sequential_sampler(params):
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        drafts = [torch.randint(0, VOCAB, (k,), generator=gen).tolist() for k in (3, 1, 4)]
        prompts, outputs = [[1, 2, 3]] * 3, [[4], [], [5, 5]]
        logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB, generator=gen) * 2
        # Make some drafts right: set each draft's logit high where the trial says so.
        row = 0
        for draft in drafts:
            for j, token in enumerate(draft):
                if (trial + j) % 3:
                    logits[row + j, token] += 6
            row += len(draft) + 1
        counts = [TokenCounts.for_params(params, p, o, VOCAB, "cpu") for p, o in zip(prompts, outputs, strict=False)]
        result = verify_chains(logits, drafts, [params] * 3, [len(o) for o in outputs], counts, {}, [0])
        row = 0
        for i, draft in enumerate(drafts):
            expected = sequential_greedy(logits[row : row + len(draft) + 1], params, prompts[i], outputs[i], draft)
            assert result.token_ids[i] == expected
            assert result.num_accepted[i] == len(expected) - 1
            row += len(draft) + 1


def histogram(values, n=VOCAB):
    return np.bincount(np.asarray(values), minlength=n)


def two_sample_chi_square(a, b):
    """Pearson's statistic for two histograms of equal totals (df = occupied bins - 1)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    keep = (a + b) > 0
    return float(((a[keep] - b[keep]) ** 2 / (a[keep] + b[keep])).sum()), int(keep.sum()) - 1


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
"""Chi-square critical values at p = 0.001 by degrees of freedom."""


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3),
])
def test_sampling_has_the_samplers_distribution_per_position(params):
    n = 20000
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(3, VOCAB, generator=gen) * 1.5  # rows: root, after draft 0, after draft 1
    draft = [int(base[0].argmax()), int(base[1].argsort()[-2])]  # a likely first draft, a second-best second
    torch.manual_seed(2)
    counts0 = TokenCounts.for_params(params, [1], [], VOCAB, "cpu")
    result = verify_chains(base.repeat(n, 1), [draft] * n, [params] * n, [0] * n, [counts0] * n, {}, [0])
    first = [t[0] for t in result.token_ids]
    # Oracle: the plain Sampler on row 0, and on row 1 after the first draft was emitted.
    meta0 = SamplingMetadata.build([params] * n, [0] * n, [counts0] * n, {}, [0], VOCAB, "cpu")
    oracle0 = Sampler()(base[:1].repeat(n, 1), meta0).sampled_token_ids.tolist()
    stat, df = two_sample_chi_square(histogram(first), histogram(oracle0))
    assert stat < CHI2_999[df], (histogram(first), histogram(oracle0))
    second = [t[1] for t in result.token_ids if t[0] == draft[0]]
    counts1 = TokenCounts.for_params(params, [1], [draft[0]], VOCAB, "cpu")
    meta1 = SamplingMetadata.build([params] * len(second), [1] * len(second), [counts1] * len(second), {}, [0],
                                   VOCAB, "cpu")
    oracle1 = Sampler()(base[1:2].repeat(len(second), 1), meta1).sampled_token_ids.tolist()
    stat, df = two_sample_chi_square(histogram(second), histogram(oracle1))
    assert stat < CHI2_999[df], (histogram(second), histogram(oracle1))
    # A wrong rule fails the same test: accept draft 0 iff it is the argmax (it is), so always emit it.
    stat, df = two_sample_chi_square(histogram([draft[0]] * n), histogram(oracle0))
    assert stat > CHI2_999[df]


def test_seeded_rows_repeat():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    runs = [verify_chains(logits, [[1, 2]], [params], [0], [None], {0: torch.Generator().manual_seed(7)}, [0])
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_takes_the_raw_argmax_first_on_ties(dtype):
    """Greedy rows with nothing to process are verified from the raw logits' argmax, in their own
    dtype (bf16: no float32 copy), through the native row argmax where it is built: the same
    tokens as argmax row by row, the first index winning a tie (small integer logits tie often)."""
    kernels = cpu_kernels()
    argmax = None if kernels is None else Sampler(kernels).argmax
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, min_tokens=2)  # past min_tokens: the raw argmax decides
    assert raw_argmax_decides([params], [2]) and not raw_argmax_decides([params], [1])
    for _ in range(50):
        drafts = [torch.randint(0, VOCAB, (k,), generator=gen).tolist() for k in (4, 0, 2, 1)]
        logits = torch.randint(0, 3, (sum(len(d) + 1 for d in drafts), VOCAB), generator=gen).to(dtype)
        result = verify_chains(logits, drafts, [params] * 4, [2] * 4, [None] * 4, {}, [0], argmax)
        row = 0
        for i, draft in enumerate(drafts):
            best = logits[row : row + len(draft) + 1].float().argmax(-1).tolist()
            accepted = next((j for j, token in enumerate(draft) if token != best[j]), len(draft))
            assert result.token_ids[i] == [*draft[:accepted], best[accepted]]
            assert result.num_accepted[i] == accepted
            row += len(draft) + 1
