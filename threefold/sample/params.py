"""SamplingParams: what a user asks of one generation (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from threefold.errors import ThreefoldError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Sampling and stopping controls, field for field as in vLLM.

    Validation happens in `__post_init__`; a bad value raises ThreefoldError
    naming the parameter.
    """

    n: int = 1
    """Number of completions to return for the prompt."""
    temperature: float = 1.0
    """0 means greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to top_p (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top one's [0, 1]."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in prompt or output (CTRL-style), > 0."""
    presence_penalty: float = 0.0
    """Subtracted once from tokens already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from tokens already generated, in [-2, 2]."""
    seed: int | None = None
    """Per-request seed: the same output whatever else is in the batch."""
    stop: list[str] | str | None = None
    """Strings that end generation; they are not part of the returned text."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to the model's EOS)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context."""
    min_tokens: int = 0
    """Generate at least this many tokens before EOS/stop tokens may end it."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    logprobs: int | None = None
    """Return this many top logprobs per generated token (plus the chosen one)."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt token (the first one is None)."""
    skip_special_tokens: bool = True
    """Drop special tokens from the returned text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the text."""
    speculative: bool = True
    """False: this request never drafts, even when the engine speculates."""
    _stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._stop_strs = [s for s in (self.stop or []) if s]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}."),
            (self.temperature >= 0.0, "temperature", f"temperature must be non-negative, got {self.temperature}."),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}."),
            (self.top_k >= 0, "top_k", f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}."),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}."),
            (self.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}."),
            (self.min_tokens >= 0, "min_tokens",
             f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
             f"logprobs must be in [0, 20], got {self.logprobs}."),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}."),
            (self.seed is None or isinstance(self.seed, int), "seed", f"seed must be an integer, got {self.seed!r}."),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []), "stop_token_ids",
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}."),
        ]
        for ok, param, message in checks:
            if not ok:
                raise ThreefoldError(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_strs

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update(changes)
        return SamplingParams(**values)
