"""The rungs of `threefold bench cost`: which techniques each configuration runs.

A rung is written as its base and the techniques stacked on it, joined by `+`:

    hf                              transformers `generate`, static batching (the naive baseline)
    cb                              threefold continuous batching: prefix caching off, no codec,
                                    no speculation, no tiers, one replica
    cb+prefix+codec+spec+tiers      ... with each technique turned on
    cb+...+rr / cb+...+router       two replicas behind the router: round-robin / the chosen policy

Which codec, speculation method and router policy "codec", "spec" and "router" mean is
set once per job (--codec, --spec-config, --router-policy). Tiers read the prefix cache's
block hashes, so `tiers` needs `prefix`.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.errors import ThreefoldError

BASES = ("hf", "cb")
TECHNIQUES = ("prefix", "codec", "spec", "tiers", "rr", "router")
"""In the order a canonical rung name lists them."""

STACK = ("cb", "cb+prefix", "cb+prefix+codec", "cb+prefix+codec+spec", "cb+prefix+codec+spec+tiers",
         "cb+prefix+codec+spec+tiers+rr", "cb+prefix+codec+spec+tiers+router")
ALONE = ("cb+codec", "cb+spec", "cb+prefix+tiers")
"""Each technique alone from continuous batching (tiers from cb+prefix: they need its hashes)."""
DEFAULT_LADDER = ",".join(("hf", *STACK, *ALONE))


@dataclass(frozen=True)
class Rung:
    name: str
    """Canonical: base, then techniques in TECHNIQUES order."""
    features: frozenset[str]
    """"cb" for a threefold rung, plus its techniques; empty for the transformers baseline."""

    @property
    def is_baseline(self) -> bool:
        return "cb" not in self.features

    @property
    def replicas(self) -> int:
        return 2 if self.features & {"rr", "router"} else 1

    def has(self, technique: str) -> bool:
        return technique in self.features


def parse_rung(text: str) -> Rung:
    """`cb+prefix+codec` -> Rung; a clear error for an unknown or impossible combination."""
    head, *rest = [part.strip() for part in text.strip().split("+")]
    if head == "hf":
        if rest:
            raise ThreefoldError(f"rung {text!r}: hf is the transformers baseline and takes no techniques; "
                                 f"stack them on cb (e.g. cb+{rest[0]})", param="rungs")
        return Rung("hf", frozenset())
    if head != "cb":
        raise ThreefoldError(f"rung {text!r}: a rung starts with one of {', '.join(BASES)}, got {head!r}",
                             param="rungs")
    unknown = [part for part in rest if part not in TECHNIQUES]
    if unknown:
        raise ThreefoldError(f"rung {text!r}: unknown technique {unknown[0]!r}; known: {', '.join(TECHNIQUES)}",
                             param="rungs")
    if len(set(rest)) != len(rest):
        raise ThreefoldError(f"rung {text!r} names a technique twice", param="rungs")
    if "tiers" in rest and "prefix" not in rest:
        raise ThreefoldError(f"rung {text!r}: KV tiers are keyed by the prefix cache's block hashes; "
                             f"add prefix (e.g. cb+prefix+tiers)", param="rungs")
    if "rr" in rest and "router" in rest:
        raise ThreefoldError(f"rung {text!r}: rr and router are two policies for the same replicas; pick one",
                             param="rungs")
    name = "+".join(["cb", *(t for t in TECHNIQUES if t in rest)])
    return Rung(name, frozenset(["cb", *rest]))


def parse_rungs(text: str) -> list[Rung]:
    """A comma-separated list of rungs, each once, in the order given."""
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise ThreefoldError("--rungs is empty; give e.g. hf,cb,cb+prefix", param="rungs")
    rungs = [parse_rung(part) for part in parts]
    names = [r.name for r in rungs]
    for name in names:
        if names.count(name) > 1:
            raise ThreefoldError(f"rung {name!r} is listed twice", param="rungs")
    return rungs


@dataclass(frozen=True)
class Comparison:
    """Two rungs that differ by one technique: `after` = `before` + technique."""

    technique: str
    before: str
    after: str
    kind: str
    """"alone" (added to plain cb, or tiers to cb+prefix) or "stacked" (on top of other techniques)."""


def comparisons(rungs: list[Rung]) -> list[Comparison]:
    """Every pair of rungs that isolates one technique. The router is compared with round-robin
    on the same replicas; a second replica (rr) with one replica; cb with the hf baseline."""
    out = []
    for before in rungs:
        for after in rungs:
            added, removed = after.features - before.features, before.features - after.features
            if removed == {"rr"} and added == {"router"}:
                out.append(Comparison("router", before.name, after.name, "stacked"))
            elif not removed and len(added) == 1:
                (technique,) = added
                plain = before.features in ({"cb"}, {"cb", "prefix"} if technique == "tiers" else {"cb"})
                out.append(Comparison(technique, before.name, after.name, "alone" if plain else "stacked"))
    return out
