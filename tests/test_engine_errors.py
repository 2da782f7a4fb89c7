"""Bad input gets a clear ThreefoldError naming the problem, and the engine keeps serving."""

from __future__ import annotations

import pytest

from threefold.engine.llm import LLM
from threefold.errors import ContextLengthError, ModelNotFoundError, ThreefoldError
from threefold.sample.params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("min_p", 2.0),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("max_tokens", 0), ("max_tokens", -1), ("min_tokens", -1), ("n", 0), ("logprobs", 50),
    ("stop_token_ids", [-1]),
])
def test_out_of_range_sampling_params_name_the_field(field, value):
    with pytest.raises(ThreefoldError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert field in str(err.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ThreefoldError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_bad_requests_fail_alone_and_others_keep_running(make_llm):
    llm = make_llm(max_model_len=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8)
    engine.add_request("good", "The capital of France is", params)
    engine.step()
    with pytest.raises(ThreefoldError, match="empty"):
        engine.add_request("empty", "", params)
    with pytest.raises(ThreefoldError, match="empty"):
        engine.add_request("empty-ids", [], params)
    with pytest.raises(ContextLengthError, match="maximum context length is 64 tokens") as err:
        engine.add_request("long", "word " * 100, params)
    assert "in the messages" in str(err.value) or "input tokens" in str(err.value)
    with pytest.raises(ContextLengthError, match="you requested 74 tokens"):
        engine.add_request("long-output", list(range(10, 20)), SamplingParams(max_tokens=64))
    with pytest.raises(ThreefoldError, match="out of vocabulary"):
        engine.add_request("oov", [1, 10**7], params)
    with pytest.raises(ThreefoldError, match="already in use"):
        engine.add_request("good", "again", params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 8
    assert engine.get_stats().kv_cache_usage == 0.0


def test_unknown_model_name_lists_known_ones():
    with pytest.raises(ModelNotFoundError) as err:
        LLM("no-such-model-xyz")
    assert "smollm2-135m" in str(err.value)


def test_bad_engine_config_is_rejected_before_loading():
    with pytest.raises(ThreefoldError, match="max_num_seqs"):
        LLM("no-such-model-xyz", max_num_seqs=0)
    with pytest.raises(ThreefoldError, match="dtype"):
        LLM("smollm2-135m", dtype="float16")
