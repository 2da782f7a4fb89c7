"""The router's FastAPI app: the OpenAI routes proxied through a Router, plus its own
/health, /metrics, /router/state and /dashboard."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from threefold.errors import ThreefoldError
from threefold.router.dashboard import add_dashboard_routes
from threefold.router.proxy import Router
from threefold.server.errors import error_response, install_handlers

_FORWARDED_HEADERS = ("content-type", "authorization", "accept")


def build_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="threefold router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = router
    install_handlers(app)

    @app.exception_handler(ThreefoldError)
    async def _threefold(_: Request, exc: ThreefoldError) -> JSONResponse:
        retry = 1 if exc.status_code == 503 else None  # no backend now: tell clients when to come back
        return error_response(exc.message, exc.status_code, exc.param, retry)

    async def proxied(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        kind, result = await router.forward(request.url.path, await request.body(), headers)
        if kind == "stream":
            return StreamingResponse(result, media_type="text/event-stream")
        status, content, media_type = result
        return Response(content, status_code=status, media_type=media_type)

    app.add_api_route("/v1/completions", proxied, methods=["POST"])
    app.add_api_route("/v1/chat/completions", proxied, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for url, health in router.health.items():
            if health.healthy:
                upstream = await router.client.get(f"{url}/v1/models",
                                                   headers={k: v for k, v in request.headers.items()
                                                            if k.lower() == "authorization"})
                return Response(upstream.content, status_code=upstream.status_code,
                                media_type=upstream.headers.get("content-type"))
        raise ThreefoldError("No healthy backend is available.", status_code=503)

    @app.get("/health")
    async def health() -> Response:
        if any(h.healthy for h in router.health.values()):
            return Response(status_code=200)
        return error_response("Unhealthy: no backend is healthy.", 503, retry_after_s=1)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = router.metrics.render(router.policy.snapshot(), {u: h.healthy for u, h in router.health.items()})
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/state")
    async def state() -> dict:
        return router.state()

    add_dashboard_routes(app, router)

    return app
