"""ServerConfig: what the HTTP front needs to know (the engine has its own EngineArgs)."""

from __future__ import annotations

from dataclasses import dataclass

from threefold.errors import ThreefoldError
from threefold.ledger.ledger import check_cost_per_hour


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    """Names clients may put in `model`; the first is the one responses and metrics use."""
    model_path: str = ""
    """What the engine loaded (shown as `root` in /v1/models)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, /v1/* requests need `Authorization: Bearer <api_key>`."""
    max_queued_requests: int | None = None
    """Answer 503 + Retry-After when this many requests already wait; None: no limit."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may run before they are aborted."""
    retry_after_s: int = 1
    """The Retry-After a 503 suggests."""
    batch_dir: str | None = None
    """Where the Batch API keeps its files and state (SQLite); None: no Batch API."""
    batch_dir_is_default: bool = False
    """batch_dir is the default one, not the user's: if another server holds it, serve without a Batch API."""
    batch_max_inflight_tokens: int = 65536
    """Estimated tokens of batch lines the engine holds at once (the offline queue limit)."""
    cost_per_hour: float | None = None
    """The price of this server per hour: the savings ledger shows cost per million tokens with it."""
    usage_ledger: bool = False
    """Add the request's savings ledger to every response's `usage` (as `usage.threefold_ledger`)."""

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ThreefoldError("served_model_names must name at least one model.", param="served_model_name")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ThreefoldError(f"max_queued_requests must be at least 1, got {self.max_queued_requests}.",
                                 param="max_queued_requests")
        if self.shutdown_timeout_s < 0:
            raise ThreefoldError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout_s}.",
                                 param="shutdown_timeout")

        check_cost_per_hour(self.cost_per_hour)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
