"""Step-time prediction over a batch's shape (plain Python: the scheduler budgets offline work with it).

One step's time is modelled as linear in its shape (HyGen's latency predictor):

    seconds = c0 + c_tok * tokens + c_seq * sequences + c_chunk * prefill chunks + c_attn * attention pairs

`c0` is the weights read once a step (most of a small step on a CPU), `tokens`
drives the linear layers, `sequences` the per-request host work and sampling,
`prefill chunks` (requests computing more than one token) the attention call
each chunk makes per layer beside the decodes' one kernel call, and `attention
pairs` (query tokens x the keys each attends) the KV read.
The coefficients are a ridge least-squares fit with forgetting: calibrated from
a startup profile (spec.adaptive.StepCostModel's (tokens, seconds) points, the
same profiling pass speculation uses), then refitted from every measured step.
"""

from __future__ import annotations

from dataclasses import dataclass

_SCALES = (1.0, 1e3, 1e2, 1e1, 1e6)
"""Feature units (1, thousand tokens, hundred sequences, ten chunks, million pairs): keeps the ridge term
even-handed."""


@dataclass
class BatchShape:
    num_tokens: int = 0
    num_seqs: int = 0
    num_chunks: int = 0
    """Sequences computing more than one token (a decode is one: the runner's decode path)."""
    attention_pairs: float = 0.0

    def add(self, num_new: int, num_computed: int) -> None:
        """One request computing num_new tokens after num_computed: each query attends its prefix."""
        self.num_tokens += num_new
        self.num_seqs += 1
        self.num_chunks += num_new > 1
        self.attention_pairs += num_new * (num_computed + (num_new + 1) / 2)

    def plus(self, num_new: int, num_computed: int) -> BatchShape:
        shape = BatchShape(self.num_tokens, self.num_seqs, self.num_chunks, self.attention_pairs)
        shape.add(num_new, num_computed)
        return shape

    def features(self) -> list[float]:
        raw = (1.0, self.num_tokens, self.num_seqs, self.num_chunks, self.attention_pairs)
        return [value / scale for value, scale in zip(raw, _SCALES, strict=True)]


class LinearStepModel:
    """seconds(shape) = coefficients . features, refitted as steps are measured."""

    def __init__(self, forgetting: float = 0.999, ridge: float = 1e-4) -> None:
        self.forgetting = forgetting
        self.ridge = ridge
        size = len(_SCALES)
        self._xtx = [[0.0] * size for _ in range(size)]
        self._xty = [0.0] * size
        self.coefficients = [0.0] * size
        self.num_observations = 0
        self._dirty = False

    @classmethod
    def from_profile(cls, profile: dict[int, float]) -> LinearStepModel:
        """Seed from forwards of n fresh tokens in one sequence (StepCostModel's points)."""
        model = cls()
        for num_tokens, seconds in sorted(profile.items()):
            shape = BatchShape()
            shape.add(num_tokens, 0)
            model.observe(shape, seconds)
        return model

    def observe(self, shape: BatchShape, seconds: float) -> None:
        x = shape.features()
        decay = self.forgetting
        for i, xi in enumerate(x):
            row = self._xtx[i]
            for j, xj in enumerate(x):
                row[j] = decay * row[j] + xi * xj
            self._xty[i] = decay * self._xty[i] + xi * seconds
        self.num_observations += 1
        self._dirty = True

    def __call__(self, shape: BatchShape) -> float:
        if self._dirty:
            self._refit()
        return sum(c * x for c, x in zip(self.coefficients, shape.features(), strict=True))

    def _refit(self) -> None:
        # Non-negative least squares by an active set: solve, drop the most negative feature, re-solve on the
        # rest. Clamping a negative coefficient to zero after one solve (the old rule) keeps the others fitted
        # against it, so every prediction came out high by what the clamp removed: an over-charged step.
        free = list(range(len(self._xty)))
        while True:
            solution = self._solve_on(free)
            negative = [i for i in free if solution[i] < 0]
            if not negative:
                break
            free.remove(min(negative, key=lambda i: solution[i]))
        self.coefficients = solution
        self._dirty = False

    def _solve_on(self, free: list[int]) -> list[float]:
        """Ridge least squares over the features in `free`; the others' coefficients are zero."""
        matrix = [[self._xtx[i][j] + (self.ridge if i == j else 0.0) for j in free] + [self._xty[i]] for i in free]
        solution = [0.0] * len(self._xty)
        for i, value in zip(free, _solve(matrix) if free else [], strict=True):
            solution[i] = value
        return solution


def _solve(augmented: list[list[float]]) -> list[float]:
    """Gaussian elimination with partial pivoting on [A | b] (A is small, symmetric positive definite)."""
    size = len(augmented)
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(augmented[r][col]))
        augmented[col], augmented[pivot] = augmented[pivot], augmented[col]
        lead = augmented[col][col]
        for row in range(col + 1, size):
            factor = augmented[row][col] / lead
            for k in range(col, size + 1):
                augmented[row][k] -= factor * augmented[col][k]
    solution = [0.0] * size
    for row in reversed(range(size)):
        rest = sum(augmented[row][k] * solution[k] for k in range(row + 1, size))
        solution[row] = (augmented[row][size] - rest) / augmented[row][row]
    return solution
