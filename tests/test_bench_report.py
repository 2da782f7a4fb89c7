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
    header = text.splitlines()[text.splitlines().index("### Serving") + 2]
    assert "TTFT p99" in header and "goodput req/s" in header
    # a row carries the run's own numbers: label, concurrency, completed/failed, throughput
    doc = json.loads(result_files[2].read_text())
    row = next(line for line in table if line.startswith("| threefold | sharegpt | inf | 4 |"))
    assert f"| 20 | 1 | {doc['summary']['request_throughput']:.3f} |" in row
    assert f"{doc['summary']['ttft']['p99'] * 1e3:.1f}" in row
    assert "### TTFT by session turn" in text and "| threefold-sessions c=4 | 2 | " in text
    assert "### Offline throughput" in text and "| transformers | transformers | 8 | 800 | 4.00 | 200.0 |" in text
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


AVX2 = {"model": "AMD EPYC 7B13", "cpu_class": "avx2", "native_bf16": False, "torch_capability": "AVX2",
        "num_threads": 2, "flags": ["avx2", "f16c", "fma"]}
AMX = {"model": "Intel(R) Xeon(R) Platinum 8481C", "cpu_class": "amx", "native_bf16": True,
       "torch_capability": "AVX512", "num_threads": 2, "flags": ["amx_bf16", "amx_tile", "avx512f"]}


def _offline(engine: str, tok_s: float, cpu: dict | None) -> dict:
    doc = {"kind": "offline", "label": engine, "engine": engine, "num_prompts": 8, "output_tokens": 800,
           "elapsed_s": 800 / tok_s, "output_tokens_per_s": tok_s, "requests_per_s": 8 / (800 / tok_s)}
    return {**doc, "cpu": cpu} if cpu else doc


def test_cpu_record_is_this_machines_cpu():
    from threefold.bench.report import cpu_record
    from threefold.cpu import CPU_CLASSES, cpu_info

    record = cpu_record()
    assert record == cpu_info().as_dict() and record["cpu_class"] in CPU_CLASSES
    assert record["model"] and record["torch_capability"] and record["num_threads"] >= 1
    assert json.loads(json.dumps(record))["cpu_class"] == record["cpu_class"]  # survives the JSON file


def test_report_keeps_one_section_per_cpu_class(tmp_path):
    docs = [_doc("threefold", 4, math.inf, 0.1, 0.02, seed=1), _doc("threefold", 4, math.inf, 0.3, 0.05, seed=2)]
    docs[0]["cpu"], docs[1]["cpu"] = AMX, AVX2
    paths = [write_results(doc, tmp_path / f"s{i}.json") for i, doc in enumerate(docs)]
    for i, doc in enumerate([_offline("transformers", 100.0, AVX2), _offline("threefold", 900.0, AMX),
                             _offline("threefold", 300.0, None)]):
        (tmp_path / f"o{i}.json").write_text(json.dumps(doc))
        paths.append(tmp_path / f"o{i}.json")
    lines = write_report(paths, tmp_path / "report").read_text().splitlines()
    headings = [line for line in lines if line.startswith("## ")]
    assert headings == ["## CPU class amx: Intel(R) Xeon(R) Platinum 8481C (torch AVX512, 2 threads)",
                        "## CPU class avx2: AMD EPYC 7B13 (torch AVX2, 2 threads)",
                        "## CPU class unknown: not recorded"]
    sections = {h: lines[lines.index(h): (lines.index(headings[i + 1]) if i + 1 < len(headings) else len(lines))]
                for i, h in enumerate(headings)}
    amx, avx2, unknown = (sections[h] for h in headings)
    rows = [line for line in amx + avx2 if line.startswith("| threefold | sharegpt |")]
    assert len(rows) == 2 and (rows[0] in amx) != (rows[1] in amx)  # one serve row in each class
    assert any("| 900.0 |" in line for line in amx) and not any("| 900.0 |" in line for line in avx2)
    assert any("| transformers |" in line for line in avx2) and not any("| transformers |" in line for line in amx)
    assert any("| 300.0 |" in line for line in unknown)


def test_serve_run_records_the_cpu_only_when_the_server_is_here():
    from threefold.bench.serve import server_cpu

    assert server_cpu("http://127.0.0.1:8000") == server_cpu("http://localhost:9") != {}
    assert server_cpu("http://127.0.0.1:8000")["cpu_class"] != "unknown"
    remote = server_cpu("http://10.1.2.3:8000")
    assert remote["cpu_class"] == "unknown" and remote["client"]["cpu_class"] != "unknown"


def test_tables_never_divide_across_cpu_classes():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("tables", Path(__file__).parents[1] / "benchmarks" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    docs = [_offline("transformers", 100.0, AVX2), _offline("threefold", 400.0, AVX2),
            _offline("threefold", 900.0, AMX)]
    text = tables.tables_by_cpu("offline", docs)
    avx2 = text[text.index("#### CPU class avx2"): text.index("#### CPU class amx")]  # first seen, first shown
    amx = text[text.index("#### CPU class amx"):]
    assert "| threefold | 8 | 800 | 2.0 | 400.0 | 4.000 | 4.00 | - | 1 |" in avx2
    # no transformers row measured on the AMX machine: no ratio, rather than 900 / 100 across machines
    assert "| threefold | 8 | 800 | 0.9 | 900.0 | 9.000 | - | - | 1 |" in amx
    assert "| 9.00 |" not in tables.offline_table(docs)  # the class is part of the key even in one mixed table
