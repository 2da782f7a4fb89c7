"""Fit the simulator's engine model from real replicas' step logs (`threefold serve --step-log FILE`).

`threefold bench calibrate` times chosen shapes on an idle engine; a serving replica runs
1.1-1.2x slower than that in a cluster here (`EngineModel.drift`), by an amount that varies from
run to run. The step log records every step a replica really ran, under the load and neighbours it
really had, so the same per-step cost model can be fitted to it instead:

    seconds = cost(tokens) + prefill_attention_s * pairs + per_context_s * context
              + per_prefill_context_s * prefix

with `cost` piecewise linear between knots at the calibration's token counts (1, 16, 128, 512,
1,024, 1,536, 2,048, those the log reaches). Every term is linear in the prices, so one
non-negative least-squares fit over all logged steps gives them all; the knot values are fitted
as non-negative increments, so more tokens never cost less (the `StepCostModel` reads its profile
that way too). Least squares fits the mean step, not the fastest: the replicas' interference is
what the fit is for. A log must hold long prefills (the steps that make TTFT's tail) and decode
steps, or the fit says which are missing instead of extrapolating.

The step log records step times only: the KV pool, block size, batch limits and HTTP delays come
from a `base` model (a calibration file), or the EngineModel defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from threefold.engine.step_log import LoggedStep, read_step_log
from threefold.errors import ThreefoldError
from threefold.sim.calibrate import PREFILL_TOKENS
from threefold.sim.engine_model import LONG_PREFILL, EngineModel, attention_pairs, step_terms

MIN_LONG_PREFILLS = 3
MIN_DECODE_STEPS = 10


def read_step_logs(paths: Iterable[str | Path]) -> list[LoggedStep]:
    """Every step of these logs, with a clear error for a missing, empty or malformed file."""
    steps: list[LoggedStep] = []
    for path in paths:
        try:
            logged = read_step_log(path)
        except FileNotFoundError as err:
            raise ThreefoldError(f"step log {path} not found", param="calibration_from_step_log") from err
        except (ValueError, TypeError) as err:  # bad JSON, a line that is not [time, seconds, [[n, before], ...]]
            raise ThreefoldError(f"step log {path} is not a threefold step log (`threefold serve --step-log`): "
                                 f"{err}", param="calibration_from_step_log") from err
        if not logged:
            raise ThreefoldError(f"step log {path} has no steps", param="calibration_from_step_log")
        steps.extend(logged)
    if not steps:
        raise ThreefoldError("no step logs given", param="calibration_from_step_log")
    return steps


def calibrate_from_step_logs(paths: Iterable[str | Path], base: EngineModel | None = None) -> EngineModel:
    """The engine model fitted to these logs' steps; everything but the step prices from `base`."""
    paths = list(paths)
    steps = read_step_logs(paths)
    model = fit_steps(steps, base)
    largest = max(step_terms(step.shape).tokens for step in steps)  # past it the profile is extrapolated
    return dataclasses.replace(model, source=f"step logs: {', '.join(str(p) for p in paths)} ({len(steps)} steps, "
                                             f"the largest {largest} tokens)")


def fit_steps(steps: Sequence[LoggedStep], base: EngineModel | None = None) -> EngineModel:
    """Non-negative least squares of the step cost model over logged steps (see the module's doc)."""
    shapes = [step_terms(step.shape) for step in steps]
    long = sum(shape.prefill >= LONG_PREFILL for shape in shapes)
    decodes = sum(shape.prefill == 0 for shape in shapes)
    if long < MIN_LONG_PREFILLS or decodes < MIN_DECODE_STEPS:
        raise ThreefoldError(
            f"the step log has {long} steps with a prefill of {LONG_PREFILL}+ tokens and {decodes} decode-only "
            f"steps; a fit needs at least {MIN_LONG_PREFILLS} and {MIN_DECODE_STEPS} (long prefills make "
            "TTFT's tail and would otherwise be extrapolated): log a replica that served long prompts, or "
            "calibrate with `threefold bench calibrate`", param="calibration_from_step_log")
    tokens = [shape.tokens for shape in shapes]
    knots = _knots(tokens)
    columns = np.array([[*_ramp(s.tokens, knots), s.pairs, s.context, s.prefill_context] for s in shapes])
    seconds = np.array([step.seconds for step in steps])
    prices = nnls(columns, seconds)
    increments, (attention, per_context, per_prefill) = prices[:len(knots)], prices[len(knots):]
    cost = np.cumsum(increments)
    profile = {k: float(c) + attention * attention_pairs(k) for k, c in zip(knots, cost, strict=True)}
    fields = {} if base is None else {f.name: getattr(base, f.name) for f in dataclasses.fields(EngineModel)
                                      if f.name in _KEPT}
    return EngineModel(profile, float(per_context), float(per_prefill), float(attention), **fields)


_KEPT = ("block_size", "num_blocks", "dispatch_delay_s", "report_delay_s", "max_num_batched_tokens", "max_num_seqs",
         "model", "cpu")


def _knots(tokens: list[int]) -> list[int]:
    """The calibration's token counts up to the largest logged step, without those that no step's
    count falls next to (their value would be a guess)."""
    knots = [k for k in PREFILL_TOKENS if k <= max(tokens)] or [PREFILL_TOKENS[0]]
    counts = np.array(tokens)
    kept = [knots[0]]
    for i, knot in enumerate(knots[1:], 1):
        upper = knots[i + 1] if i + 1 < len(knots) else float("inf")
        if np.any((counts > kept[-1]) & (counts < upper)):
            kept.append(knot)
    return kept


def _ramp(n: int, knots: list[int]) -> list[float]:
    """`StepCostModel(profile)(n)` as weights of the profile's increments (value i = the sum of increments
    0..i): constant below the first knot, linear between knots, the last segment's slope past the last."""
    last = len(knots) - 1
    if last == 0:
        return [1.0 if n <= knots[0] else n / max(knots[0], 1)]
    weights = [1.0] + [0.0] * last
    for i in range(1, last + 1):
        fraction = max(0.0, (n - knots[i - 1]) / (knots[i] - knots[i - 1]))
        weights[i] = fraction if i == last else min(fraction, 1.0)
    return weights


def nnls(a: np.ndarray, b: np.ndarray, max_iterations: int = 200) -> np.ndarray:
    """min |a x - b| over x >= 0 (Lawson and Hanson's active set). Columns are scaled to unit norm
    first (prices per token and per attention pair differ by orders of magnitude); a column of zeros
    (a term no step has) gets 0."""
    norms = np.linalg.norm(a, axis=0)
    usable = norms > 0
    scaled = np.where(usable, a / np.where(usable, norms, 1.0), 0.0)
    tolerance = 1e-10 * max(1.0, float(np.linalg.norm(b)))
    x = np.zeros(a.shape[1])
    active = np.zeros(a.shape[1], dtype=bool)
    for _ in range(max_iterations):
        gradient = scaled.T @ (b - scaled @ x)
        candidates = ~active & usable & (gradient > tolerance)
        if not candidates.any():
            break
        active[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros_like(x)
            z[active] = np.linalg.lstsq(scaled[:, active], b, rcond=None)[0]
            if (z[active] > 0).all():
                x = z
                break
            falling = active & (z <= 0)
            step = float(np.min(x[falling] / (x[falling] - z[falling])))
            x = x + step * (z - x)
            active &= x > tolerance
            x[~active] = 0.0
    return np.where(usable, x / np.where(usable, norms, 1.0), 0.0)
