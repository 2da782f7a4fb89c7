"""$THREEFOLD_CPU_CLASS: a CPU runs as a lesser class (issue 9's AVX2 rows measured on an AVX-512 machine).

The class, the flags and the dtype choice follow it; the engine loads that class's kernel
build; torch's own kernels (ATen, oneDNN, MKL) are capped through the environment, checked
in a fresh interpreter, since a library that has run keeps its ISA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from threefold.bench.peers import run_as_env
from threefold.cpu import RUN_AS_ENV, _proc_cpuinfo, classify, cpu_class, cpu_info
from threefold.errors import ThreefoldError
from threefold.kernels import engine_target
from threefold.model.precision import resolve_precision

OWN_CLASS = classify(_proc_cpuinfo()[1])
ABOVE_AVX2 = OWN_CLASS in ("amx", "avx512")


@pytest.mark.skipif(OWN_CLASS not in ("amx", "avx512", "avx2"), reason="not an x86 CPU with AVX2")
def test_running_as_avx2_takes_its_class_flags_dtype_and_kernel_build(monkeypatch):
    monkeypatch.setenv("THREEFOLD_CPU_CLASS", "avx2")
    info = cpu_info()
    assert info.cpu_class == cpu_class() == "avx2" and not info.native_bf16
    assert "avx2" in info.flags and not any(f.startswith(("avx512", "amx")) for f in info.flags)
    assert engine_target() == ("x86-64-v3" if ABOVE_AVX2 else "native")
    assert info.run_as == ("avx2" if ABOVE_AVX2 else None)  # an AVX2 CPU runs as itself
    assert ("(run as avx2)" in info.model) == ABOVE_AVX2
    precision = resolve_precision("auto", torch.bfloat16, "cpu", info, mixed_kernel=True)
    assert (precision.compute, precision.weights) == (torch.float32, torch.bfloat16)  # bf16-weights
    monkeypatch.delenv("THREEFOLD_CPU_CLASS")
    assert cpu_info().cpu_class == OWN_CLASS and cpu_info().run_as is None and engine_target() == "native"


def test_a_class_one_cannot_run_as_is_refused(monkeypatch):
    monkeypatch.setenv("THREEFOLD_CPU_CLASS", "amx-ish")
    with pytest.raises(ThreefoldError, match="THREEFOLD_CPU_CLASS"):
        cpu_info()


@pytest.mark.skipif(not ABOVE_AVX2, reason="capping torch needs a CPU above AVX2")
def test_running_as_avx2_caps_torch_and_what_it_starts():
    keys = sorted(RUN_AS_ENV["avx2"])
    script = ("import json, os, torch\n"
              "from threefold.cpu import apply_run_as\n"
              "cls = apply_run_as()\n"
              "capability = torch.backends.cpu.get_cpu_capability(), torch.backends.mkldnn.enabled\n"
              f"print(json.dumps([cls, capability, {{k: os.environ.get(k) for k in {keys!r}}}]))")
    env = {k: v for k, v in os.environ.items() if k not in RUN_AS_ENV["avx2"]}
    out = subprocess.run([sys.executable, "-c", script], env={**env, "THREEFOLD_CPU_CLASS": "avx2"},
                         capture_output=True, text=True, timeout=120, check=True)
    cls, capability, seen = json.loads(out.stdout.splitlines()[-1])
    assert (cls, capability, seen) == ("avx2", ["AVX2", False], RUN_AS_ENV["avx2"])  # bf16 matmul: ATen's


@pytest.mark.skipif(not ABOVE_AVX2, reason="the probes only lie on a CPU above AVX2")
def test_peers_see_the_class_run_as_through_torch_cpu_probes(monkeypatch):
    """vLLM CPU picks its kernel build by torch.cpu's probes: under run_as_env they say no AVX-512."""
    monkeypatch.setenv("THREEFOLD_CPU_CLASS", "avx2")
    probe = ("import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), "
             "torch.backends.mkldnn.enabled)")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **run_as_env()}, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
    monkeypatch.delenv("THREEFOLD_CPU_CLASS")
    assert run_as_env() == {}
