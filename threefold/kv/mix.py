"""Per-layer codec mixes: `mix:SPEC@LAYERS;SPEC@LAYERS;...` (what the quality guard chooses).

    mix:kivi4@0-2,7;kivi2@3-6,8-29    ->  layer 0..2 and 7 in kivi4, the rest in kivi2

Every layer is named exactly once. The canonical text (specs resolved, entries ordered by
their first layer, layers written as ranges) is the identity of the cache: it goes into logs,
/metrics, prefix-cache hash seeds and KV-store keys, so a different mix never reuses blocks.
A plain spec (`kivi2`) is the mix that gives every layer the same codec.

Plain Python (config validates mixes, and config must not import torch).
"""

from __future__ import annotations

from threefold.errors import ThreefoldError
from threefold.kv.spec import KVSpec, parse_kv_spec

PREFIX = "mix:"
UNMIXED = ("tiered",)
"""Codecs that must be every layer's (the guard's ladders and mixes take the others)."""


def is_mix(text: str) -> bool:
    return isinstance(text, str) and text.strip().lower().startswith(PREFIX)


def _error(text: str, why: str) -> ThreefoldError:
    return ThreefoldError(f"kv_cache_dtype {text!r}: {why}; write a mix as mix:SPEC@LAYERS;SPEC@LAYERS "
                          f"(e.g. mix:kivi4@0-2,7;kivi2@3-6,8-29), naming every layer once.",
                          param="kv_cache_dtype")


def _layers(text: str, part: str) -> list[int]:
    layers: list[int] = []
    for item in part.split(","):
        lo, dash, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise _error(text, f"{item.strip()!r} is not a layer or a range of layers") from None
        if first < 0 or last < first:
            raise _error(text, f"bad layer range {item.strip()!r}")
        layers.extend(range(first, last + 1))
    return layers


def parse_mix(text: str, num_layers: int | None = None) -> list[KVSpec]:
    """The spec of every layer; `num_layers` (when known) must match the layers named."""
    by_layer: dict[int, KVSpec] = {}
    for entry in text.strip()[len(PREFIX):].split(";"):
        spec_text, at, layer_text = entry.rpartition("@")
        if not at or not spec_text.strip():
            raise _error(text, f"entry {entry.strip()!r} has no SPEC@LAYERS")
        if is_mix(spec_text):
            raise _error(text, "a mix cannot nest")
        spec = parse_kv_spec(spec_text)
        for layer in _layers(text, layer_text):
            if layer in by_layer:
                raise _error(text, f"layer {layer} is named twice")
            by_layer[layer] = spec
    expected = len(by_layer) if num_layers is None else num_layers
    missing = sorted(set(range(expected)) - set(by_layer))
    extra = sorted(set(by_layer) - set(range(expected)))
    if missing or extra:
        raise _error(text, f"the model has {expected} layers; missing {missing[:8]}, unknown {extra[:8]}")
    if any(s.name in UNMIXED for s in by_layer.values()) and len({str(s) for s in by_layer.values()}) > 1:
        raise _error(text, f"{', '.join(UNMIXED)} cannot share a cache with other codecs (its per-request "
                           f"band is sized for every layer); use it alone")
    return [by_layer[layer] for layer in range(expected)]


def _ranges(layers: list[int]) -> str:
    parts, start = [], 0
    for i, layer in enumerate(layers):
        if i == 0 or layer != layers[i - 1] + 1:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
    return ",".join(parts)


def mix_text(specs: list[KVSpec]) -> str:
    """Canonical text: a plain spec when every layer has the same codec, else the mix."""
    names = [str(s) for s in specs]
    if len(set(names)) == 1:
        return names[0]
    groups: dict[str, list[int]] = {}
    for layer, name in enumerate(names):
        groups.setdefault(name, []).append(layer)
    return PREFIX + ";".join(f"{name}@{_ranges(layers)}" for name, layers in groups.items())


def layer_specs(text: str, num_layers: int) -> list[KVSpec]:
    """Every layer's spec for a plain spec or a mix."""
    if is_mix(text):
        return parse_mix(text, num_layers)
    return [parse_kv_spec(text)] * num_layers
