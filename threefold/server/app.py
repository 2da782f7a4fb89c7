"""The FastAPI app: routes, the serving middleware (auth, drain, abort-on-exit), and build_app()."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from threefold.batch.runner import RunnerConfig
from threefold.engine.async_engine import AsyncEngine
from threefold.errors import ThreefoldError
from threefold.server.batch_routes import add_batch_routes
from threefold.server.config import ServerConfig
from threefold.server.dashboard import add_dashboard_routes
from threefold.server.errors import error_response_bytes, install_handlers
from threefold.server.ledger import LedgerRecorder, build_ledger
from threefold.server.metrics import ServerMetrics
from threefold.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from threefold.server.serving_batch import BatchService
from threefold.server.serving_chat import create_chat_completion
from threefold.server.serving_common import STREAMS_SCOPE_KEY, ServerState, now_s
from threefold.server.serving_completions import create_completion
from threefold.server.serving_tokenize import detokenize, tokenize, tokenizer_info

logger = logging.getLogger(__name__)

_OPEN_WHILE_DRAINING = ("/metrics",)  # still answered after SIGTERM, so the drain can be watched


class ServingMiddleware:
    """Raw ASGI middleware wrapped around every HTTP request.

    - while draining (SIGTERM), new requests get 503 + Retry-After;
    - with an API key set, /v1/* needs `Authorization: Bearer <key>` (401 otherwise);
    - it counts in-flight requests (the drain waits for them);
    - when the HTTP call ends for any reason (done, client gone, exception), it
      aborts the engine requests the call started and did not finish, so KV
      blocks are never held for a client that is not listening.
    """

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rejection = self._reject(scope)
        if rejection is not None:
            await _send_error(send, *rejection)
            return
        streams = scope.setdefault(STREAMS_SCOPE_KEY, [])
        self.state.num_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_inflight -= 1
            self.state.engine.abort([s.request_id for s in streams if not s.finished])

    def _reject(self, scope: dict) -> tuple[int, str, dict[str, str]] | None:
        path = scope["path"]
        if self.state.draining and path not in _OPEN_WHILE_DRAINING:
            retry = {"retry-after": str(self.state.config.retry_after_s)}
            return 503, "The server is shutting down and accepts no new requests.", retry
        key = self.state.config.api_key
        if key and path.startswith("/v1") and not _authorized(scope, key):
            return 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.", {}
        return None


def _authorized(scope: dict, key: str) -> bool:
    headers = dict(scope.get("headers") or [])
    auth = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = auth.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _send_error(send: Any, status: int, message: str, headers: dict[str, str]) -> None:
    body = error_response_bytes(message, status)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="threefold", docs_url=None, redoc_url=None)
    app.state.server = state
    install_handlers(app)
    _add_routes(app, state)
    add_batch_routes(app, state)
    add_dashboard_routes(app, state)
    app.add_middleware(ServingMiddleware, state=state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def list_models() -> dict:
        data = [{"id": name, "object": "model", "created": now_s(), "owned_by": "threefold",
                 "root": state.config.model_path or name, "parent": None, "max_model_len": state.max_model_len}
                for name in state.config.served_model_names]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(state, req, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(state, req, raw_request)

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest) -> dict:
        return tokenize(state, req)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest) -> dict:
        return detokenize(state, req)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict:
        return tokenizer_info(state)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_healthy and not state.draining:
            return Response(status_code=200)
        reason = state.engine.dead_reason or "shutting down"
        return JSONResponse({"error": {"message": f"Unhealthy: {reason}.", "type": "ServiceUnavailableError",
                                       "param": None, "code": 503}}, status_code=503)

    @app.get("/version")
    async def version() -> dict:
        from threefold import __version__
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def make_state(engine: Any, config: ServerConfig) -> ServerState:
    """Wrap a loaded LLMEngine: metrics, the async engine loop (started), and the shared state."""
    metrics = ServerMetrics(config.model_name)
    cache_info = getattr(getattr(engine, "core", None), "cache_info", None)
    if cache_info:
        metrics.set_cache_config(cache_info)
    offload = getattr(getattr(engine, "core", None), "offload", None)
    if offload is not None:  # threefold:kv_offload_* per tier, read from the store at each scrape
        from threefold.kvstore.metrics import KVOffloadCollector

        metrics.registry.register(KVOffloadCollector(offload.store.stats, config.model_name, offload.block_size,
                                                      offload.engine_stats))
    ledger = build_ledger(engine, config.cost_per_hour)
    loggers = [metrics] + ([LedgerRecorder(ledger, metrics.registry, config.model_name)] if ledger else [])
    async_engine = AsyncEngine(engine, stat_loggers=loggers).start()
    state = ServerState(config=config, engine=async_engine, tokenizer=engine.tokenizer, metrics=metrics,
                        max_model_len=engine.max_model_len, generation_defaults=dict(engine.generation_defaults),
                        vocab_size=getattr(engine, "vocab_size", None) or engine.tokenizer.vocab_size, ledger=ledger)
    if config.batch_dir is not None:  # resumes the batches a previous server left unfinished
        runner_config = RunnerConfig(max_inflight_tokens=config.batch_max_inflight_tokens)
        try:
            state.batch = BatchService(state, config.batch_dir, runner_config=runner_config).start()
        except ThreefoldError as exc:
            if not (config.batch_dir_is_default and exc.param == "batch_dir"):
                async_engine.shutdown()
                raise
            # Another server took the default dir first (replicas started together): serve without it.
            logger.warning("%s (This server serves no Batch API.)", exc)
        except Exception:
            async_engine.shutdown()
            raise
    return state
