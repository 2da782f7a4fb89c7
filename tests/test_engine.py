"""The engine on the real default model: batch invariance, prefix caching, preemption, accounting."""

from __future__ import annotations

import pytest

from threefold.engine.step_log import read_step_log
from threefold.sample.params import SamplingParams

from prompts import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def texts(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(make_llm):
    """Each prompt alone: the greedy tokens every batched configuration must reproduce."""
    llm = make_llm(enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("caching,budget", [(True, 512), (False, 512), (True, 5), (False, 7)])
def test_batch_invariance(make_llm, reference, caching, budget):
    llm = make_llm(enable_prefix_caching=caching, max_num_batched_tokens=budget)
    assert texts(llm.generate(PROMPTS, GREEDY)) == reference
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_shared_prefix_computed_once(make_llm):
    llm = make_llm()
    prefix = "You are a helpful assistant. Answer briefly and precisely, in one sentence. " * 2
    first = llm.generate([prefix + "What is a cat?"], GREEDY)[0]
    second = llm.generate([prefix + "What is a dog?"], GREEDY)[0]
    num_blocks = len(first.prompt_token_ids) // 16
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 16 * (num_blocks - 1) > 0
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits == second.num_cached_tokens
    cold = make_llm(enable_prefix_caching=False).generate([prefix + "What is a dog?"], GREEDY)[0]
    assert second.outputs[0].token_ids == cold.outputs[0].token_ids


def test_preemption_under_memory_pressure(make_llm, smollm2_fp32, reference):
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # K+V, 30 layers, 16 tokens, 3 kv heads, dim 64, fp32
    llm = make_llm(kv_cache_memory=12 * block_bytes, max_model_len=64)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert texts(outputs) == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0


def test_abort_frees_blocks_and_others_finish(make_llm, reference):
    llm = make_llm()
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()
    engine.step()
    engine.abort_request(["1", "3"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"0": reference[0], "2": reference[2]}
    assert engine.get_stats().kv_cache_usage == 0.0
    assert engine.core.kv.req_to_blocks == {}


def test_n_completions_share_prompt_blocks(make_llm):
    llm = make_llm()
    engine = llm.engine
    prompt = PROMPTS[2] * 4  # several full blocks
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))
    engine.step()
    tables = [engine.core.kv.block_ids(f"r-{i}") for i in range(3)]
    num_full = len(engine.requests["r"].prompt_token_ids) // 16
    assert num_full >= 2
    assert tables[0][:num_full] == tables[1][:num_full] == tables[2][:num_full]
    while engine.has_unfinished_requests():
        outs = engine.step()
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_seeded_sampling_same_in_any_batch(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompts = [PROMPTS[5], PROMPTS[6], PROMPTS[0], PROMPTS[7], PROMPTS[8], PROMPTS[9]]
    batch = llm.generate(prompts, [noise, noise, params, noise, noise, noise])
    assert batch[2].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate([PROMPTS[0]], params.clone(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone


def test_stop_string_is_cut_and_reported(make_llm):
    llm = make_llm()
    free = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    stop = free.text[10:14]
    assert stop.strip(), free.text
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.text == free.text[: free.text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == out.text + stop
    assert llm.engine.get_stats().num_running == 0


def test_stop_token_ids_min_tokens_and_length(make_llm):
    llm = make_llm()
    free = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    third = free.token_ids[2]
    out = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[third]))[0]
    assert out.outputs[0].token_ids == free.token_ids[:3]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", third)
    eos = llm.engine.eos_token_ids[0]
    forced = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=6, min_tokens=6,
                                                       stop_token_ids=[third]))[0].outputs[0]
    assert len(forced.token_ids) == 6 and forced.finish_reason == "length"
    assert eos not in forced.token_ids


def test_logprobs_and_prompt_logprobs_shapes(make_llm):
    llm = make_llm()
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in position and position[token_id].rank == 1  # greedy picks the top token
        assert 3 <= len(position) <= 4
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs, strict=True)))
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token_id, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert token_id in position and len(position) <= 3


def test_chat_uses_the_template(make_llm):
    llm = make_llm()
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=8))[0]
    template = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert "<|im_start|>" in template
    assert out.prompt_token_ids == llm.get_tokenizer().encode(template, add_special_tokens=False)
    assert out.outputs[0].text


def test_decodes_of_very_different_lengths_batch_exactly(make_llm):
    """Decodes are bucketed by context length; each bucket must still equal a solo run."""
    llm = make_llm(max_num_batched_tokens=1024)
    prompts = [PROMPTS[0], PROMPTS[1] * 6, PROMPTS[2] * 20, PROMPTS[3] * 2]
    solo = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert texts(llm.generate(prompts, GREEDY)) == solo


def test_length_buckets_bound_padding():
    from threefold.worker.batch import _length_buckets

    lengths = [3, 10, 20, 40, 300, 310, 2000]
    buckets = _length_buckets(lengths, 16)
    # block counts 1,1,2,3,19,20,126: a bucket grows while blocks <= 1.5 x its first + 1
    assert buckets == [(0, 3), (3, 4), (4, 6), (6, 7)]


def test_the_step_log_records_each_steps_shape_and_time(make_llm, tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = make_llm(step_log=str(path))
    llm.generate([{"prompt_token_ids": list(range(300, 320))}, {"prompt_token_ids": list(range(400, 405))}],
                 SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    llm.close()
    steps = read_step_log(path)
    # both prompts in one step, then each decodes over the tokens it has computed
    assert [sorted(s.shape) for s in steps] == [[(5, 0), (20, 0)], [(1, 5), (1, 20)], [(1, 6), (1, 21)]]
    assert all(s.seconds > 0 for s in steps)
    assert steps[0].time < steps[1].time < steps[2].time
    assert read_step_log(path, since=steps[1].time) == steps[1:]
