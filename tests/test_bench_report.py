"""`bench report` turns result JSONs into a markdown table and PNG plots."""

from __future__ import annotations

import json
import math
import random

import pytest

from threefold.bench.client import RequestResult
from threefold.bench.metrics import SLO, summarize
from threefold.bench.report import load_results, write_report
from threefold.bench.serve import result_document, write_results
from threefold.errors import ThreefoldError


def _results(n: int, ttft: float, tpot: float, seed: int, turns: int = 0) -> list[RequestResult]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        first = ttft * rng.uniform(0.5, 1.5)
        tokens = rng.randint(8, 32)
        out.append(RequestResult(ok=True, ttft=first, e2e=first + tpot * (tokens - 1), itl=[tpot] * (tokens - 1),
                                 prompt_tokens=100, output_tokens=tokens, cached_tokens=50 if turns else 0,
                                 prompt_len=100, turn=i % turns if turns else None))
    out.append(RequestResult(ok=False, error="HTTP 503: busy"))
    return out


def _doc(label: str, conc: int | None, rate: float, ttft: float, tpot: float, seed: int, dataset="sharegpt",
         turns: int = 0) -> dict:
    results = _results(20, ttft, tpot, seed, turns)
    summary = summarize(results, duration=10.0, slo=SLO(ttft=0.5, tpot=0.05))
    config = {"dataset": dataset, "max_concurrency": conc, "request_rate": rate, "model": "m"}
    return result_document(config, label, {"num_requests": 21}, results, summary)


@pytest.fixture
def result_files(tmp_path):
    docs = [_doc(label, c, math.inf, ttft * c, 0.02 * c, seed=c)
            for label, ttft in (("threefold", 0.1), ("vllm", 0.2)) for c in (1, 2, 4)]
    docs += [_doc("threefold", None, r, 0.1 * r, 0.01 * r, seed=10 + r) for r in (1, 2)]
    docs.append(_doc("threefold-sessions", 4, math.inf, 0.2, 0.02, seed=99, dataset="sharegpt-sessions", turns=3))
    paths = [write_results(doc, tmp_path / "runs" / f"r{i}.json") for i, doc in enumerate(docs)]
    offline = {"kind": "offline", "label": "transformers", "engine": "transformers", "num_prompts": 8,
               "output_tokens": 800, "elapsed_s": 4.0, "output_tokens_per_s": 200.0, "requests_per_s": 2.0}
    (tmp_path / "runs" / "offline.json").write_text(json.dumps(offline))
    return [*paths, tmp_path / "runs" / "offline.json"]


def test_report_writes_table_and_plots(result_files, tmp_path):
    md = write_report(result_files, tmp_path / "report")
    text = md.read_text()
    table = [line for line in text.splitlines() if line.startswith(("| threefold |", "| vllm |"))]
    assert len(table) == 8  # 3 + 3 concurrency runs, 2 rate runs
    header = text.splitlines()[text.splitlines().index("## Serving") + 2]
    assert "TTFT p99" in header and "goodput req/s" in header
    # a row carries the run's own numbers: label, concurrency, completed/failed, throughput
    doc = json.loads(result_files[2].read_text())
    row = next(line for line in table if line.startswith("| threefold | sharegpt | inf | 4 |"))
    assert f"| 20 | 1 | {doc['summary']['request_throughput']:.3f} |" in row
    assert f"{doc['summary']['ttft']['p99'] * 1e3:.1f}" in row
    assert "## TTFT by session turn" in text and "| threefold-sessions c=4 | 2 | " in text
    assert "## Offline throughput" in text and "| transformers | transformers | 8 | 800 | 4.00 | 200.0 |" in text
    pngs = sorted(p.name for p in md.parent.glob("*.png"))
    assert pngs == ["goodput_vs_rate.png", "throughput_vs_concurrency.png", "tpot_cdf.png", "ttft_cdf.png",
                    "ttft_per_turn.png"]
    for name in pngs:
        data = (md.parent / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"]({name})" in text


def test_report_rejects_foreign_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ThreefoldError):
        load_results([bad])
