"""The simulator's model of one engine replica: step time and prefix-cache size.

A continuous-batching step computes some prefill tokens and one token per
running decode. Its time is modelled as

    step(tokens, context, prefix) = cost(tokens) + per_context_s * context
                                    + per_prefill_context_s * prefix

`cost` is the spec package's StepCostModel (piecewise linear in the step's
token count, measured on prefill-only steps, so prefill attention is inside
it); `context` is the total KV length the step's decodes attend over, and
`per_context_s` its fitted price. `prefix` sums, over the step's prefill chunks, chunk
tokens x the tokens before the chunk (a cached prefix, earlier chunks): the attention a
chunk pays over context it did not compute in this step, which the zero-context token
profile leaves out (a later turn's few new tokens read the whole conversation). All three
come from `threefold bench calibrate`
(threefold/sim/calibrate.py), which times the real engine and saves this as
JSON; `EngineModel.load` reads it back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from threefold.errors import ThreefoldError
from threefold.spec.adaptive import StepCostModel


@dataclass(frozen=True)
class StepPoint:
    """One measured step: prefill tokens, decode count, decodes' total context, seconds."""

    prefill_tokens: int
    num_decodes: int
    context: int
    seconds: float


@dataclass
class EngineModel:
    token_profile: dict[int, float]
    """Step seconds by token count (prefill-only steps): StepCostModel's points."""
    per_context_s: float
    """Seconds per token of KV context that the step's decodes attend over."""
    per_prefill_context_s: float = 0.0
    """Seconds per (prefill token x context token before its chunk); 0 in older calibration files."""
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
    points: list[StepPoint] = field(default_factory=list)
    """The raw measurements the fit came from (kept for the record and for refits)."""

    def __post_init__(self) -> None:
        self.token_profile = {int(k): float(v) for k, v in self.token_profile.items()}
        self.cost = StepCostModel(self.token_profile)  # raises on an empty profile

    def step_seconds(self, num_tokens: int, context: int, prefill_context: int = 0) -> float:
        return self.cost(num_tokens) + self.per_context_s * context + self.per_prefill_context_s * prefill_context

    def prefill_seconds_per_token(self) -> float:
        """Marginal prefill cost at a full step: DualMap's `tpct`."""
        top = self.max_num_batched_tokens
        return self.cost(top) / top

    # ---- fitting and files -------------------------------------------------

    @classmethod
    def fit(cls, points: list[StepPoint], **fields) -> EngineModel:
        """Token profile from the fresh prefill-only points (min per count); per_context_s and
        per_prefill_context_s by least squares over the residuals (time minus the token cost) of
        the decode points and of the prefill-after-a-cached-prefix points, never negative."""
        prefill = [p for p in points if p.num_decodes == 0 and p.context == 0]
        if not prefill:
            raise ThreefoldError("calibration needs at least one prefill-only step", param="calibration")
        profile: dict[int, float] = {}
        for p in prefill:
            profile[p.prefill_tokens] = min(profile.get(p.prefill_tokens, float("inf")), p.seconds)
        cost = StepCostModel(profile)
        decode = [p for p in points if p.num_decodes > 0 and p.context > 0]
        per_context = _slope([p.context for p in decode],
                             [p.seconds - cost(p.prefill_tokens + p.num_decodes) for p in decode])
        prefixed = [p for p in points if p.num_decodes == 0 and p.context > 0]
        per_prefill = _slope([p.prefill_tokens * p.context for p in prefixed],
                             [p.seconds - cost(p.prefill_tokens) for p in prefixed])
        return cls(profile, per_context, per_prefill, points=list(points), **fields)

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


def _slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope through the origin, never negative; 0 without points."""
    if not x:
        return 0.0
    xs, ys = np.array(x, dtype=float), np.array(y, dtype=float)
    return max(0.0, float(xs @ ys / (xs @ xs)))
