"""The simulator's model of one engine replica: step time and prefix-cache size.

A continuous-batching step computes some prefill tokens and one token per
running decode. Its time is modelled as

    step(tokens, chunks, context, prefix) = cost(tokens) + prefill_attention_s * sum(pairs(chunk))
                                            + per_context_s * context + per_prefill_context_s * prefix

`cost` is the spec package's StepCostModel (piecewise linear in the step's token
count), taken from prefill-only steps (one fresh prompt per step) with their
causal attention removed: a chunk of c tokens attends over itself in pairs(c) =
c (c + 1) / 2 (token, earlier token) pairs, so a 2,048-token prompt pays its
attention and two 1,024-token prompts in one step pay half as much for the same
2,048 tokens. `prefill_attention_s` is fitted from exactly that difference
(the same token count as one prompt and split over several in one step).
`context` is the total KV length the step's decodes attend over, and
`per_context_s` its fitted price. `prefix` sums, over the step's prefill chunks, chunk
tokens x the tokens before the chunk (a cached prefix, earlier chunks): the attention a
chunk pays over context it did not compute in this step (a later turn's few new tokens
read the whole conversation). All of them come from `threefold bench calibrate`
(threefold/sim/calibrate.py), which times the real engine and saves this as
JSON; `EngineModel.load` reads it back. Older files have no split steps and no
`prefill_attention_s` (0): their profile keeps the attention inside `cost`, as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np

from threefold.engine.step_log import LoggedStep
from threefold.errors import ThreefoldError
from threefold.spec.adaptive import StepCostModel

K = TypeVar("K")


@dataclass(frozen=True)
class StepPoint:
    """One measured step: prefill tokens, decode count, decodes' total context, seconds, and the number
    of fresh prompts the prefill tokens are split over in equal parts (1 in older files)."""

    prefill_tokens: int
    num_decodes: int
    context: int
    seconds: float
    prompts: int = 1


LONG_PREFILL = 512
"""New tokens in a step from which a prefill counts as long: the steps that make TTFT's tail (`drift`
reports them apart; a step-log fit needs some, sim/step_fit.py)."""


class StepTerms(NamedTuple):
    """What the engine model prices in a logged step (its shape: (tokens this step, tokens computed
    before) per request; one token is a decode over its context, more a prefill chunk)."""

    tokens: int
    prefill: int
    """Tokens of the prefill chunks."""
    pairs: int
    """Attention pairs inside the chunks."""
    context: int
    """The decodes' contexts, summed."""
    prefill_context: int
    """Each chunk's tokens x the tokens before it, summed."""


def step_terms(shape: Iterable[tuple[int, int]]) -> StepTerms:
    chunks = [(n, before) for n, before in shape if n > 1]
    decodes = [before for n, before in shape if n == 1]
    prefill = sum(n for n, _ in chunks)
    return StepTerms(prefill + len(decodes), prefill, sum(attention_pairs(n) for n, _ in chunks), sum(decodes),
                     sum(n * before for n, before in chunks))


def attention_pairs(chunk: int) -> int:
    """(token, earlier-or-same token) pairs of a prefill chunk's causal attention over itself."""
    return chunk * (chunk + 1) // 2


@dataclass
class EngineModel:
    token_profile: dict[int, float]
    """Step seconds by token count, one fresh prompt per step, as measured (attention included)."""
    per_context_s: float
    """Seconds per token of KV context that the step's decodes attend over."""
    per_prefill_context_s: float = 0.0
    """Seconds per (prefill token x context token before its chunk); 0 in older calibration files."""
    prefill_attention_s: float = 0.0
    """Seconds per attention pair inside a prefill chunk (`attention_pairs`); `cost` is the profile less
    this. 0 in older calibration files (the profile then charges every step as one prompt's)."""
    block_size: int = 16
    num_blocks: int = 4096
    """KV blocks of one replica (its budget / bytes per block): the prefix cache's capacity."""
    dispatch_delay_s: float = 0.0
    """Router binds a request -> its replica's scheduler has it (HTTP, parsing, chat template, tokenizing),
    measured through a real router (`threefold.sim.delays`); 0 in older files."""
    report_delay_s: float = 0.0
    """A replica's step made a token -> the router and client see it (detokenizing, SSE, HTTP); 0 in older files."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    model: str = ""
    cpu: str = ""
    source: str = ""
    """What the step prices were fitted from: "" for `threefold bench calibrate`'s `points`, else the
    step logs (`threefold.sim.step_fit`)."""
    points: list[StepPoint] = field(default_factory=list)
    """The raw measurements the fit came from (kept for the record and for refits)."""

    def __post_init__(self) -> None:
        self.token_profile = {int(k): float(v) for k, v in self.token_profile.items()}
        self.cost = StepCostModel(_without_attention(self.token_profile, self.prefill_attention_s))
        # (StepCostModel raises on an empty profile)

    def step_seconds(self, num_tokens: int, context: int, prefill_context: int = 0, chunk_pairs: int = 0) -> float:
        """`num_tokens` computed (prefill + one per decode); `chunk_pairs`: the prefill chunks' `attention_pairs`."""
        return (self.cost(num_tokens) + self.prefill_attention_s * chunk_pairs + self.per_context_s * context
                + self.per_prefill_context_s * prefill_context)

    def shape_seconds(self, shape: Iterable[tuple[int, int]]) -> float:
        """A step as the step log records it: (tokens this step, tokens computed before) per request."""
        terms = step_terms(shape)
        return self.step_seconds(terms.tokens, terms.context, terms.prefill_context, terms.pairs)

    def drift(self, steps: Iterable[LoggedStep]) -> dict[str, dict[str, float]]:
        """Measured against modelled seconds of real steps (a replica's `--step-log`), per kind of step:
        how much slower (> 1) or faster the replicas ran than this calibration predicts."""
        kinds: dict[str, list[float]] = {}
        for step in steps:
            prefill = step_terms(step.shape).prefill
            kind = ("decode only" if not prefill else f"prefill >= {LONG_PREFILL}" if prefill >= LONG_PREFILL
                    else f"prefill < {LONG_PREFILL}")
            for name in (kind, "all"):
                totals = kinds.setdefault(name, [0, 0.0, 0.0])
                totals[0] += 1
                totals[1] += step.seconds
                totals[2] += self.shape_seconds(step.shape)
        return {name: {"steps": n, "measured_s": measured, "modelled_s": modelled,
                       "ratio": measured / modelled if modelled else float("nan")}
                for name, (n, measured, modelled) in kinds.items()}

    def prefill_seconds(self, num_tokens: int) -> float:
        """One fresh prompt of `num_tokens` prefilled in one step."""
        return self.step_seconds(num_tokens, 0, 0, attention_pairs(num_tokens))

    def prefill_seconds_per_token(self) -> float:
        """Marginal prefill cost at a full step: DualMap's `tpct`."""
        top = self.max_num_batched_tokens
        return self.prefill_seconds(top) / top

    # ---- fitting and files -------------------------------------------------

    @classmethod
    def fit(cls, points: list[StepPoint], **fields) -> EngineModel:
        """Token profile from the one-prompt prefill-only points (min per count). The attention price
        from the split points: one prompt of P tokens against k prompts of P/k in one step (min per
        shape) cost the same token count, so their difference is the attention pairs they differ by.
        per_context_s and per_prefill_context_s by least squares over the residuals (time minus the
        modelled prefill) of the decode points and of the prefill-after-a-cached-prefix points.
        All prices are never negative."""
        prefill = [p for p in points if p.num_decodes == 0 and p.context == 0 and p.prompts == 1]
        if not prefill:
            raise ThreefoldError("calibration needs at least one prefill-only step", param="calibration")
        profile = _min_by(prefill, lambda p: p.prefill_tokens)
        split = _min_by([p for p in points if p.num_decodes == 0 and p.context == 0 and p.prompts > 1],
                        lambda p: (p.prefill_tokens, p.prompts))
        single = StepCostModel(profile)
        attention = _slope([attention_pairs(n) - k * attention_pairs(n // k) for n, k in split],
                           [single(n) - seconds for (n, k), seconds in split.items()])
        fitted = cls(profile, 0.0, prefill_attention_s=attention, **fields)
        decode = [p for p in points if p.num_decodes > 0 and p.context > 0]
        per_context = _slope([p.context for p in decode],
                             [p.seconds - fitted.cost(p.prefill_tokens + p.num_decodes) for p in decode])
        prefixed = [p for p in points if p.num_decodes == 0 and p.context > 0]
        per_prefill = _slope([p.prefill_tokens * p.context for p in prefixed],
                             [p.seconds - fitted.prefill_seconds(p.prefill_tokens) for p in prefixed])
        return cls(profile, per_context, per_prefill, attention, points=list(points), **fields)

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "points"}
        data["token_profile"] = {str(k): v for k, v in self.token_profile.items()}
        data["points"] = [asdict(p) for p in self.points]
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> EngineModel:
        try:
            data = json.loads(Path(path).read_text())
            points = [StepPoint(**p) for p in data.pop("points", [])]
            return cls(**data, points=points)
        except FileNotFoundError as err:
            raise ThreefoldError(f"calibration file {path} not found; make one with "
                                 "`threefold bench calibrate --out FILE`", param="calibration") from err
        except (TypeError, ValueError, KeyError) as err:
            raise ThreefoldError(f"calibration file {path} is not a threefold engine model: {err}",
                                 param="calibration") from err


def _min_by(points: list[StepPoint], key: Callable[[StepPoint], K]) -> dict[K, float]:
    """The fastest time per shape (`key`): the step without outside interference."""
    best: dict[K, float] = {}
    for p in points:
        best[key(p)] = min(best.get(key(p), float("inf")), p.seconds)
    return best


def _without_attention(profile: dict[int, float], per_pair: float) -> dict[int, float]:
    """The token profile less each point's own causal attention (a no-op at price 0)."""
    return {tokens: max(0.0, seconds - per_pair * attention_pairs(tokens)) for tokens, seconds in profile.items()}


def _slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope through the origin, never negative; 0 without points."""
    if not x:
        return 0.0
    xs, ys = np.array(x, dtype=float), np.array(y, dtype=float)
    return max(0.0, float(xs @ ys / (xs @ xs)))
