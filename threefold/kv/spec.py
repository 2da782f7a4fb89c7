"""KV-cache codec specs: `name` or `name:key=value,key=value` (vLLM's `kv_cache_dtype`).

    int4:group=32          ->  KVSpec("int4", (("group", 32),))
    fp8                    ->  KVSpec("fp8_e4m3", ())          (an alias)

Plain Python (CacheConfig validates specs, and config must not import torch):
each codec's parameters, defaults and allowed values live here, next to its
name, and the codec class reads the resolved values from `KVSpec.params`.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.errors import ThreefoldError


@dataclass(frozen=True)
class Param:
    """One integer parameter of a codec, with its allowed values."""

    default: int
    choices: tuple[int, ...] | range
    help: str

    def choices_text(self) -> str:
        if isinstance(self.choices, range):
            return f"[{self.choices.start}, {self.choices.start + self.choices.step}, ..., {self.choices[-1]}]"
        return str(list(self.choices))


@dataclass(frozen=True)
class KVSpec:
    """A resolved codec spec: canonical name plus every parameter (defaults filled in)."""

    name: str
    params: tuple[tuple[str, int], ...] = ()

    def __getitem__(self, key: str) -> int:
        return dict(self.params)[key]

    def __str__(self) -> str:
        """Canonical text: goes into logs, metrics and the prefix-hash seed."""
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params)


_GROUPS = (8, 16, 32, 64, 128)
_KIVI = {"group": Param(32, _GROUPS, "tokens per key scale (keys per channel) and channels per value scale"),
         "residual": Param(128, range(0, 1025, 8), "recent tokens kept in full precision, a multiple of group")}

_GEAR = {"bits": Param(2, (2, 4), "bits of the KIVI backbone's codes"),
         **_KIVI,
         "rank": Param(2, range(17), "rank of the low-rank residual per block and KV head (0: none)"),
         "outliers": Param(20, range(101), "outliers kept exact, in PER-MILLE of a block-head's entries "
                                              "(20 = 2%: the 1% largest and the 1% smallest)"),
         "loop": Param(3, range(1, 7), "power-iteration rounds for the low-rank residual")}

SCHEMAS: dict[str, dict[str, Param]] = {
    "auto": {},
    "int8": {},
    "fp8_e4m3": {},
    "fp8_e5m2": {},
    "int4": {"group": Param(32, _GROUPS, "head_dim channels sharing one scale and zero point")},
    "kivi2": _KIVI,
    "kivi4": _KIVI,
    "gear": _GEAR,
    "turboquant": {"kbits": Param(3, (1, 2, 3, 4), "Lloyd-Max bits per rotated key coordinate"),
                   "vbits": Param(2, (1, 2, 3, 4), "Lloyd-Max bits per rotated value coordinate"),
                   "qjl": Param(1, (0, 1), "1: add the 1-bit QJL residual to keys (unbiased scores)"),
                   "seed": Param(0, range(2 ** 31), "seed of the random signs and the QJL projection"),
                   "residual": Param(0, range(0, 1025, 8), "recent tokens kept in full precision, as KIVI's "
                                                           "window (0: none, every token compressed)")},
    "tiered": {**_KIVI,
               "middle": Param(512, range(0, 8193, 8), "tokens behind the window kept at 4 bits (older ones: "
                                                       "2 bits), a multiple of group"),
               "sink": Param(4, range(33), "first tokens kept in full precision (attention sinks)")},
}
"""Every codec's parameters. A new codec adds one line here and one class in kv/codecs."""

ALIASES = {"fp8": "fp8_e4m3"}


def choices_text() -> str:
    names = sorted([*SCHEMAS, *ALIASES])
    return ", ".join(names)


def parse_kv_spec(text: str) -> KVSpec:
    """Parse and validate a spec; every error lists what is allowed."""
    if not isinstance(text, str) or not text.strip():
        raise ThreefoldError(f"kv_cache_dtype must be a non-empty string; choices: {choices_text()}.",
                             param="kv_cache_dtype")
    name, _, rest = text.strip().partition(":")
    name = ALIASES.get(name.strip().lower(), name.strip().lower())
    schema = SCHEMAS.get(name)
    if schema is None:
        raise ThreefoldError(f"unknown kv_cache_dtype {text!r}; choices: {choices_text()}.", param="kv_cache_dtype")
    given = _parse_params(text, rest, schema)
    params = tuple((key, given.get(key, p.default)) for key, p in schema.items())
    spec = KVSpec(name, params)
    if "group" in schema and "residual" in schema and spec["residual"] % spec["group"]:
        raise ThreefoldError(f"kv_cache_dtype {text!r}: residual={spec['residual']} must be a multiple of "
                             f"group={spec['group']} (the window is quantized a whole group at a time).",
                             param="kv_cache_dtype")
    if "middle" in schema and spec["middle"] % spec["group"]:
        raise ThreefoldError(f"kv_cache_dtype {text!r}: middle={spec['middle']} must be a multiple of "
                             f"group={spec['group']} (the band ages a whole group at a time).", param="kv_cache_dtype")
    return spec


def _parse_params(text: str, rest: str, schema: dict[str, Param]) -> dict[str, int]:
    given: dict[str, int] = {}
    if not rest.strip():
        return given
    allowed = ", ".join(f"{k} in {p.choices_text()} ({p.help})" for k, p in schema.items()) or "none"
    for item in rest.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ThreefoldError(f"malformed kv_cache_dtype {text!r}: expected name:key=value,...; "
                                 f"parameters: {allowed}.", param="kv_cache_dtype")
        if key not in schema:
            raise ThreefoldError(f"kv_cache_dtype {text!r}: unknown parameter {key!r}; parameters: {allowed}.",
                                 param="kv_cache_dtype")
        if key in given:
            raise ThreefoldError(f"kv_cache_dtype {text!r}: {key} given twice.", param="kv_cache_dtype")
        try:
            number = int(value)
        except ValueError:
            raise ThreefoldError(f"kv_cache_dtype {text!r}: {key}={value!r} is not an integer; "
                                 f"{key} in {schema[key].choices_text()} ({schema[key].help}).",
                                 param="kv_cache_dtype") from None
        if number not in schema[key].choices:
            raise ThreefoldError(f"kv_cache_dtype {text!r}: {key}={number} is out of range; "
                                 f"{key} in {schema[key].choices_text()}.", param="kv_cache_dtype")
        given[key] = number
    return given


def split_spec_list(text: str) -> list[str]:
    """A comma-separated list of specs, where specs hold commas of their own (a benchmark's --codecs):
    "auto,gear:rank=1,outliers=0,mix:kivi4@0-2,7;kivi2@3-6,8-29" -> ["auto", "gear:rank=1,outliers=0",
    "mix:kivi4@0-2,7;kivi2@3-6,8-29"]. A part starts a new spec unless it is one more parameter
    (has "=" and no ":") or one more layer range of a mix (starts with a digit)."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        continues = part[:1].isdigit() or ("=" in part and ":" not in part)
        if continues and specs:
            specs[-1] += "," + part
        elif part:
            specs.append(part)
    return specs
