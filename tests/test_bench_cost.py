"""`threefold bench cost`: rung parsing, verdicts, the HumanEval sandbox, bad input, and one real
end-to-end run (in-process servers over the real model, a handful of requests)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from threefold.bench.cli import add_parser, main
from threefold.bench.cost import cost_main
from threefold.bench.cost_plot import stacked_chain
from threefold.bench.cost_quality import humaneval_problems, passes, truncate
from threefold.bench.cost_report import SHOW, SOME, TRULY, verdicts
from threefold.bench.cost_rungs import DEFAULT_LADDER, comparisons, parse_rung, parse_rungs
from threefold.errors import ThreefoldError


def test_rungs_parse_to_canonical_names_and_refuse_nonsense():
    assert parse_rung("cb+spec+prefix").name == "cb+prefix+spec"
    assert parse_rung("cb+prefix+codec+spec+tiers+router").replicas == 2
    assert parse_rung("hf").is_baseline
    for bad, words in (("cb+turbo", "unknown technique 'turbo'"), ("vllm", "starts with one of"),
                       ("hf+prefix", "takes no techniques"), ("cb+tiers", "add prefix"),
                       ("cb+rr+router", "pick one"), ("cb+spec+spec", "twice")):
        with pytest.raises(ThreefoldError, match=words):
            parse_rung(bad)
    with pytest.raises(ThreefoldError, match="listed twice"):
        parse_rungs("cb,cb+prefix,cb+prefix")


def test_default_ladder_isolates_every_technique_stacked_and_alone():
    found = {(c.technique, c.before, c.after, c.kind) for c in comparisons(parse_rungs(DEFAULT_LADDER))}
    assert ("cb", "hf", "cb", "stacked") in found
    assert ("prefix", "cb", "cb+prefix", "alone") in found
    assert ("spec", "cb+prefix+codec", "cb+prefix+codec+spec", "stacked") in found
    assert ("spec", "cb", "cb+spec", "alone") in found
    assert ("codec", "cb", "cb+codec", "alone") in found
    assert ("tiers", "cb+prefix", "cb+prefix+tiers", "alone") in found
    assert ("router", "cb+prefix+codec+spec+tiers+rr", "cb+prefix+codec+spec+tiers+router", "stacked") in found
    chain = [label for _, label in stacked_chain(parse_rungs(DEFAULT_LADDER))]
    assert chain == ["hf", "+cb", "+prefix", "+codec", "+spec", "+tiers", "+rr", "+router"]  # alone rungs drop out


def _row(name: str, cost: float, later: float = 1.0) -> dict:
    classes = {c: {"s_per_token_p50": v} for c, v in (("later turns", later), ("first turns", 1.0),
                                                       ("humaneval", 1.0))}
    return {"rung": name, "completed": 10, "cost_per_m_output_tokens": cost, "classes": classes,
            "peak_rss_bytes": 1, "quality": None}


def test_verdicts_follow_the_stated_rule():
    rungs = parse_rungs("cb,cb+prefix,cb+spec,cb+prefix+spec,cb+codec")
    rows = {r["rung"]: r for r in (_row("cb", 10.0), _row("cb+prefix", 8.0), _row("cb+spec", 9.8),
                                    _row("cb+prefix+spec", 7.0), _row("cb+codec", 10.1, later=0.5))}
    found = {v["technique"]: v["verdict"] for v in verdicts(comparisons(rungs), rows, noise=0.05)}
    assert found["prefix"] == TRULY  # -20% alone, -28.6% on top of spec
    assert found["spec"] == SOME  # -2% alone (noise), -12.5% on top of prefix
    assert found["codec"] == SOME  # cost flat, but later turns' seconds per token halved
    rows["cb+codec"] = _row("cb+codec", 10.1)
    assert {v["technique"]: v["verdict"] for v in verdicts(comparisons(rungs), rows, 0.05)}["codec"] == SHOW


def test_humaneval_sandbox_runs_the_tests_with_a_timeout():
    problem = humaneval_problems()["HumanEval/0"]
    assert passes(problem, problem["canonical_solution"] + "\ndef unrelated():\n    pass\n")
    assert not passes(problem, "    return False\n")
    assert not passes(problem, "    while True:\n        pass\n", timeout_s=1.0)
    assert truncate("    return 1\nprint('x')") == "    return 1"


@pytest.mark.parametrize("args, words", [
    (["--rungs", "cb,cb+warp"], "unknown technique 'warp'"),
    (["--cost-per-hour", "fifty"], "expected a price per hour"),
    (["--cost-per-hour", "-1"], "finite number > 0"),
    (["--codec", "int3"], "int3"),
    (["--codec", "kivi4", "--rungs", "cb,cb+codec+spec"], "KIVI codecs refuse speculative decoding"),
])
def test_bad_input_is_a_clear_cli_error(args, words, capsys, tmp_path):
    try:
        code = main(["bench", "cost", *args, "--out-dir", str(tmp_path)])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert words in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_cost_end_to_end_writes_table_json_and_waterfall(tmp_path, capsys, smollm2_fp32):
    out = tmp_path / "cost"
    parser = argparse.ArgumentParser(prog="threefold")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["bench", "cost", "--in-process", "--rungs", "cb,cb+prefix", "--dtype", "float32",
                            "--sessions", "1", "--max-turns", "2", "--first-turns", "1", "--humaneval", "1",
                            "--max-output-len", "8", "--think-time", "0", "--kv-cache-memory", "64MiB",
                            "--max-model-len", "1024", "--quality-sequences", "1", "--quality-len", "48",
                            "--cost-per-hour", "2.5", "--out-dir", str(out)])
    code = cost_main(ns, loaded=smollm2_fp32)  # the command's own function, over the session's fp32 model
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "cost.json").read_text())
    assert [r["rung"] for r in doc["rungs"]] == ["cb", "cb+prefix"]
    for row in doc["rungs"]:
        assert row["completed"] == 4 and row["failed"] == 0  # 2 session turns, 1 first turn, 1 HumanEval
        assert row["output_tokens"] == doc["workload"]["output_tokens"]  # ignore_eos: same work every rung
        expected = 2.5 * row["duration_s"] / 3600 / row["output_tokens"] * 1e6
        assert math.isclose(row["cost_per_m_output_tokens"], expected)
        assert row["ttft_p50_s"] > 0 and row["itl_p50_s"] > 0
        assert row["quality"]["kl_mean"] < 1e-3 and row["quality"]["top1_agreement"] > 0.95  # fp32 vs fp32
        assert row["pass_at_1"] in (0.0, 1.0) and row["same_as_cb"] == 1.0  # greedy: prefix caching is exact
        assert row["ledgers"][0]["num_requests"] >= 4
    assert doc["rungs"][1]["cached_token_ratio"] > 0  # the session's second turn hit the prefix cache
    assert [v["technique"] for v in doc["verdicts"]] == ["prefix"]
    table = (out / "cost.md").read_text()
    assert "| cb+prefix |" in table and "Verdict rule" in table and "CPU class" in table
    assert (out / "cost_waterfall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
