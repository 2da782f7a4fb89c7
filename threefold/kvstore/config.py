"""Offload tiers' configuration: flags, LLM(...) keywords and an LMCache-like YAML file, one dataclass.

    --kv-offload-cpu-bytes 4GiB --kv-offload-disk DIR --kv-offload-disk-bytes 50GB
    --kv-offload-redis redis://127.0.0.1:6379 --kv-offload-codec int8 --kv-offload-config FILE

The same names with underscores are `LLM(...)` keywords (`kv_offload_cpu_bytes=...`); a YAML file holds
either those names or the field names below (`cpu_bytes: 4GiB`). Flags and keywords override the file.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from threefold.errors import ThreefoldError
from threefold.kv.spec import parse_kv_spec

DEFAULT_DISK_BYTES = 10 << 30
REDIS_SCHEMES = ("redis", "rediss", "unix")

# Decimal units are powers of 1000 and binary ones of 1024, as printed by disks and by `free`; a bare
# "4G" is refused because users mean both.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

# option name (flag / LLM keyword, without the prefix) -> dataclass field
_OPTIONS = {"cpu_bytes": "cpu_bytes", "disk": "disk_dir", "disk_bytes": "disk_bytes",
            "redis": "redis_url", "codec": "codec"}
PREFIX = "kv_offload_"
OPTION_NAMES = (*(PREFIX + o for o in _OPTIONS), PREFIX + "config")
"""The `LLM(...)` keywords and argparse destinations: kv_offload_cpu_bytes, ..., kv_offload_config."""


def parse_bytes(value: int | float | str, param: str) -> int:
    """`4GiB`, `50GB`, `512MiB`, `1.5GiB` or a plain number of bytes -> int bytes."""
    if isinstance(value, bool):
        raise ThreefoldError(f"{param} must be a size such as 4GiB or 50GB, not {value!r}.", param=param)
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = _SIZE.match(str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ThreefoldError(f"{param}={value!r} is not a size; write e.g. 4GiB, 512MiB, 50GB or a number "
                                 f"of bytes (units: {', '.join(u for u in _UNITS if u)}, case-insensitive).",
                                 param=param)
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise ThreefoldError(f"{param}={value!r} must not be negative.", param=param)
    return int(number * _UNITS[unit])


@dataclass(frozen=True)
class OffloadConfig:
    """Which KV tiers below the engine's pool exist, and how large each is. All off by default."""

    cpu_bytes: int = 0
    """L2: host memory for offloaded blocks, bytes (0 = no L2)."""
    disk_dir: str | None = None
    """L3: a local directory, one file per block; survives restarts (None = no L3)."""
    disk_bytes: int = DEFAULT_DISK_BYTES
    """L3's size limit, bytes: the least recently used files go first."""
    redis_url: str | None = None
    """L4: a Redis server shared by instances, `redis://host:port[/db]` (None = no L4). Size it with
    Redis' own `maxmemory` and `maxmemory-policy allkeys-lru`."""
    codec: str | None = None
    """KV codec spec the offloaded blocks are stored in (e.g. "int8"); None = the pool's own."""

    def __post_init__(self) -> None:
        # Sizes may arrive as text ("4GiB") from flags and YAML; store them as ints.
        object.__setattr__(self, "cpu_bytes", parse_bytes(self.cpu_bytes, "kv_offload_cpu_bytes"))
        object.__setattr__(self, "disk_bytes", parse_bytes(self.disk_bytes, "kv_offload_disk_bytes"))
        if self.disk_dir is not None:
            if not str(self.disk_dir).strip():
                raise ThreefoldError("kv_offload_disk must be a directory path.", param="kv_offload_disk")
            object.__setattr__(self, "disk_dir", str(Path(self.disk_dir).expanduser()))
            if self.disk_bytes <= 0:
                raise ThreefoldError("kv_offload_disk_bytes must be positive when kv_offload_disk is set.",
                                     param="kv_offload_disk_bytes")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        if self.codec is not None:
            try:
                object.__setattr__(self, "codec", str(parse_kv_spec(self.codec)))
            except ThreefoldError as exc:
                raise ThreefoldError(exc.message.replace("kv_cache_dtype", "kv_offload_codec"),
                                     param="kv_offload_codec") from None

    @property
    def enabled(self) -> bool:
        """Whether any tier is configured."""
        return self.cpu_bytes > 0 or self.disk_dir is not None or self.redis_url is not None

    @classmethod
    def from_yaml(cls, path: str | Path) -> OffloadConfig:
        """Read a YAML mapping of field names (`cpu_bytes`) or option names (`kv_offload_cpu_bytes`)."""
        return cls(**_yaml_fields(path))

    @classmethod
    def from_options(cls, **options: Any) -> OffloadConfig:
        """From `LLM(...)`-style keywords: the YAML file `kv_offload_config` (if any), overridden by the
        other `kv_offload_*` options that are not None."""
        config_file = options.pop(PREFIX + "config", None)
        values = _yaml_fields(config_file) if config_file else {}
        for name, value in options.items():
            short = name.removeprefix(PREFIX)
            if short not in _OPTIONS:
                raise ThreefoldError(f"unknown KV offload option {name!r}; options: {', '.join(OPTION_NAMES)}.",
                                     param=name)
            if value is not None:
                values[_OPTIONS[short]] = value
        return cls(**values)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> OffloadConfig:
        """From the flags `add_offload_args` added."""
        return cls.from_options(**{name: getattr(ns, name, None) for name in OPTION_NAMES})


def check_redis_url(url: str) -> None:
    """Refuse what cannot be a Redis URL now, rather than failing on the first offload."""
    parsed = urlparse(url)
    if parsed.scheme not in REDIS_SCHEMES or not (parsed.hostname or parsed.path):
        raise ThreefoldError(f"kv_offload_redis={url!r} is not a Redis URL; write redis://HOST:PORT[/DB] "
                             f"(schemes: {', '.join(REDIS_SCHEMES)}).", param="kv_offload_redis")
    try:
        parsed.port  # noqa: B018 - raises ValueError on a non-numeric or out-of-range port
    except ValueError:
        raise ThreefoldError(f"kv_offload_redis={url!r} has a bad port.", param="kv_offload_redis") from None


def _yaml_fields(path: str | Path | None) -> dict[str, Any]:
    import yaml  # a dependency of transformers and gguf; only needed here

    try:
        data = yaml.safe_load(Path(str(path)).read_text())
    except OSError as exc:
        raise ThreefoldError(f"cannot read kv_offload_config {path}: {exc.strerror}.",
                             param="kv_offload_config") from None
    except yaml.YAMLError as exc:
        raise ThreefoldError(f"kv_offload_config {path} is not valid YAML: {exc}.",
                             param="kv_offload_config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ThreefoldError(f"kv_offload_config {path} must hold a mapping of keys to values.",
                             param="kv_offload_config")
    names = {f.name for f in fields(OffloadConfig)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        short = str(key).removeprefix(PREFIX)
        name = short if short in names else _OPTIONS.get(short)
        if name is None:
            raise ThreefoldError(f"kv_offload_config {path}: unknown key {key!r}; keys: {', '.join(sorted(names))} "
                                 f"(or the same with the {PREFIX} option names).", param="kv_offload_config")
        values[name] = value
    return values


def add_offload_args(parser: argparse.ArgumentParser) -> None:
    """The tier flags, for `serve`, `generate` and the bench commands."""
    group = parser.add_argument_group("KV offload tiers (below the engine's KV pool)")
    group.add_argument("--kv-offload-cpu-bytes", default=None, metavar="SIZE",
                       help="L2 host-memory tier size, e.g. 4GiB (default: off)")
    group.add_argument("--kv-offload-disk", default=None, metavar="DIR",
                       help="L3 disk tier directory; survives restarts (default: off)")
    group.add_argument("--kv-offload-disk-bytes", default=None, metavar="SIZE",
                       help=f"L3 size limit, e.g. 50GB (default: {DEFAULT_DISK_BYTES >> 30}GiB)")
    group.add_argument("--kv-offload-redis", default=None, metavar="URL",
                       help="L4 Redis tier shared by instances, e.g. redis://127.0.0.1:6379 (default: off)")
    group.add_argument("--kv-offload-codec", default=None, metavar="SPEC",
                       help="KV codec of offloaded blocks, e.g. int8 (default: the pool's own)")
    group.add_argument("--kv-offload-config", default=None, metavar="FILE",
                       help="YAML file with the same settings (flags override it)")
