"""The one exception type users see, and what the server maps to HTTP errors."""

from __future__ import annotations


class ThreefoldError(ValueError):
    """Bad input or configuration, with a message a user can act on.

    `param` names the offending parameter (the server returns it in the
    OpenAI error body); `status_code` is the HTTP status the server uses.
    """

    def __init__(self, message: str, param: str | None = None, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code


class ModelNotFoundError(ThreefoldError):
    """An unknown model name or a path that holds no model."""

    def __init__(self, message: str, param: str | None = "model") -> None:
        super().__init__(message, param=param, status_code=404)


class ContextLengthError(ThreefoldError):
    """Prompt plus requested tokens exceed the model's context."""
