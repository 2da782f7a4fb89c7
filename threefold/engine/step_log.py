"""The step log (`--step-log FILE`): one JSON line per model step, when it ran, how long, and its shape.

A line is `[unix time, seconds, [[tokens, computed], ...]]`: for each request the step ran, the tokens it
computed for it and the tokens that request had computed before (a decode is `[1, its context]`, a prefill
chunk after a cached prefix `[chunk, prefix]`). Those are the shapes the simulator's engine model prices
(`threefold.sim.engine_model`), so a log taken on a serving replica says how far its real steps are from
the calibration (`EngineModel.drift`), under the load and neighbours the replica really had.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoggedStep:
    time: float
    """Unix time the step's forward began."""
    seconds: float
    shape: tuple[tuple[int, int], ...]
    """(tokens computed this step, tokens computed before) per request."""


class StepLog:
    """Appends one line per step, line-buffered (a killed server keeps every step it finished)."""

    def __init__(self, path: str | Path) -> None:
        self._file = Path(path).open("a", buffering=1)  # noqa: SIM115 - open for the engine's life, closed by close()

    def record(self, began: float, seconds: float, shape: list[tuple[int, int]]) -> None:
        self._file.write(json.dumps([round(began, 6), round(seconds, 6), shape]) + "\n")

    def close(self) -> None:
        self._file.close()


def wall_time(perf_counter_start: float) -> float:
    """The unix time of a `time.perf_counter()` reading taken moments ago."""
    return time.time() - (time.perf_counter() - perf_counter_start)


def read_step_log(path: str | Path, since: float = 0.0, until: float = float("inf")) -> list[LoggedStep]:
    """The steps of a log that began in [since, until)."""
    steps = []
    for line in Path(path).read_text().splitlines():
        began, seconds, shape = json.loads(line)
        if since <= began < until:
            steps.append(LoggedStep(began, seconds, tuple((int(n), int(c)) for n, c in shape)))
    return steps
