"""Package layering (docs/ARCHITECTURE.md, "Layers"), checked by walking the imports of every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "threefold"

# package -> imports it must never make
FORBIDDEN = {
    "core": ("torch", "threefold.model", "threefold.worker", "threefold.kv", "threefold.engine",
             "threefold.server"),
    "model": ("threefold.core", "threefold.worker", "threefold.engine", "threefold.server"),
    "kv": ("threefold.core.scheduler", "threefold.engine", "threefold.server"),
    "kvstore": ("torch", "threefold.core.scheduler", "threefold.engine", "threefold.server", "threefold.model",
                "threefold.worker"),  # payloads are opaque bytes: the engine encodes and decodes them
    "server": ("threefold.model", "threefold.worker", "threefold.core", "threefold.kv"),
    "router": ("threefold.engine", "threefold.core", "threefold.model", "threefold.worker"),
}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_layers(package):
    offenders = [f"{path.relative_to(ROOT.parent)} imports {name}"
                 for path in sorted((ROOT / package).rglob("*.py")) for name in imports_of(path)
                 if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package])]
    assert not offenders, "\n".join(offenders)


def test_the_walker_can_fail(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import torch\nfrom threefold.model.llama import CausalLM\n")
    assert {"torch", "threefold.model.llama"} <= imports_of(bad)


def test_core_is_mypy_clean():
    """CONTRIBUTING.md, "Types": the plain-Python core type-checks on its own (`make lint` checks the rest)."""
    api = pytest.importorskip("mypy.api")
    stdout, _, _ = api.run([str(ROOT / "core"), str(ROOT / "config.py"), "--ignore-missing-imports",
                            "--follow-imports=silent", "--no-error-summary"])
    # follow-imports=silent: only the files named above report; match on ": error:" so the check holds
    # whatever the working directory (mypy prints paths relative to it, or absolute).
    core_errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert not core_errors, "\n".join(core_errors)
