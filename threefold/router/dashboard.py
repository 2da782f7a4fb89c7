"""The router's live dashboard: the cluster at a glance, each replica's numbers beside the router's own.

GET /dashboard                  one static page (the server's vendored uPlot; no external URL)
GET /dashboard/static/{name}    the page's files: its own script, uPlot from threefold.server's static/
GET /dashboard/data             the router's per-backend state, each replica's own /dashboard/data
                                (fetched over HTTP, as everything the router knows), and their sums
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources

import httpx
from fastapi import FastAPI
from fastapi.responses import Response

from threefold.errors import ThreefoldError
from threefold.router.proxy import Router

_SHARED = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "uPlot.LICENSE": "text/plain",
           "dashboard_common.js": "text/javascript", "dashboard.css": "text/css"}
"""The server's static files this page uses too (named here, not imported: threefold.server pulls in the engine)."""
_OWN = {"router_dashboard.js": "text/javascript"}
_CSP = "default-src 'self'; style-src 'self' 'unsafe-inline'"
"""The page may load nothing but this router's own files: the browser itself enforces it."""
SUMMED = ("generation_tokens", "prompt_tokens", "running", "waiting", "prefix_cache_queries", "prefix_cache_hits")


def add_dashboard_routes(app: FastAPI, router: Router) -> None:
    @app.get("/dashboard")
    async def dashboard() -> Response:
        page = resources.files("threefold.router").joinpath("static", "router_dashboard.html").read_bytes()
        return Response(page, media_type="text/html", headers={"content-security-policy": _CSP})

    @app.get("/dashboard/static/{name}")
    async def static(name: str) -> Response:
        package = "threefold.server" if name in _SHARED else "threefold.router"
        media = _SHARED.get(name) or _OWN.get(name)
        if media is None:
            raise ThreefoldError(f"No dashboard file {name!r}.", status_code=404)
        return Response(resources.files(package).joinpath("static", name).read_bytes(), media_type=media)

    @app.get("/dashboard/data")
    async def data() -> dict:
        return await dashboard_data(router)


async def _replica_data(router: Router, url: str) -> dict | None:
    """A replica's own dashboard numbers; None when it is down or does not answer within a second."""
    try:
        response = await router.client.get(f"{url}/dashboard/data", timeout=1.0)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def dashboard_data(router: Router) -> dict:
    urls = list(router.health)
    replicas = await asyncio.gather(*(_replica_data(router, url) for url in urls))
    state = router.state()["backends"]
    backends = [{"url": url, **state[url], "replica": replica} for url, replica in zip(urls, replicas, strict=True)]
    answering = [r for r in replicas if r is not None]
    totals: dict = {key: sum(r.get(key) or 0 for r in answering) for key in SUMMED}
    queries = totals["prefix_cache_queries"]
    totals["prefix_hit_rate"] = totals["prefix_cache_hits"] / queries if queries else None
    totals["routed"] = sum(b.get("routed", 0) for b in backends)
    return {"time": time.time(), "policy": router.policy.name, "totals": totals, "backends": backends,
            "replicas_answering": len(answering)}
