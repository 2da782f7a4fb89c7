"""`threefold serve`: load the model, start the engine loop, serve HTTP until SIGTERM.

SIGTERM (or Ctrl-C) drains: new requests get 503, in-flight ones run for up
to --shutdown-timeout seconds (then they are aborted), and the process exits 0.
A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from threefold.cli import add_engine_args, engine_args_from, quiet_openmp
from threefold.config import SERVING_PREFILL_TOKENS
from threefold.errors import ThreefoldError

if TYPE_CHECKING:  # the app's modules load torch: `threefold serve --help` stays fast without them
    from threefold.engine.llm_engine import EngineArgs
    from threefold.server.serving_common import ServerState

logger = logging.getLogger("threefold.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)  # --model, --dtype, --max-model-len, --kv-cache-memory, --max-num-seqs, ...
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in `model` (default: --model)")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="answer 503 + Retry-After once this many requests are waiting (default: no limit)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted")
    parser.add_argument("--batch-dir", default=None,
                        help="where the Batch API keeps files and state (default: $THREEFOLD_HOME/batches)")
    parser.add_argument("--batch-max-inflight-tokens", type=int, default=65536,
                        help="estimated tokens of batch lines in the engine at once (the offline queue limit)")
    parser.add_argument("--cost-per-hour", type=_price, default=None, metavar="PRICE",
                        help="what this server costs per hour (e.g. 0.50): /v1/ledger shows cost per million "
                             "tokens with and without each technique")
    parser.add_argument("--usage-ledger", action="store_true",
                        help="add each request's savings ledger to its response `usage` (usage.threefold_ledger)")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a price per hour such as 0.50, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a price per hour must be a finite number >= 0, got {text!r}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(parser)
    parser.set_defaults(func=run_server)
    return parser


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing the socket at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None:  # second signal: the default, immediate exit
            super().handle_exit(sig, frame)
            return
        logger.info("signal %s: draining (up to %.0f s), new requests get 503", sig, self.shutdown_timeout_s)
        self.state.draining = True
        if self.state.batch is not None:  # batch lines take no new work; what runs is redone after a restart
            self.state.batch.runner.stopping = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))

    async def drain(self) -> None:
        """Wait for in-flight requests (up to the timeout), abort what is left, then stop uvicorn."""
        if not await self._wait_idle(self.shutdown_timeout_s):
            logger.warning("shutdown timeout: aborting %d in-flight requests", self.state.num_inflight)
            self.state.engine.abort_all()
            await self._wait_idle(5.0)  # let the aborted responses flush
        self.should_exit = True

    async def _wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.state.num_inflight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def build_server(args: argparse.Namespace) -> DrainingServer:
    """Load the engine and wire the app; the caller runs `server.run()`."""
    from threefold.engine.llm_engine import LLMEngine
    from threefold.server.app import build_app, make_state
    from threefold.server.config import ServerConfig

    config = ServerConfig(served_model_names=tuple(args.served_model_name or [args.model]), model_path=args.model,
                          host=args.host, port=args.port, api_key=args.api_key,
                          max_queued_requests=args.max_queued_requests, shutdown_timeout_s=args.shutdown_timeout,
                          batch_dir=_batch_dir(args), batch_dir_is_default=args.batch_dir is None,
                          batch_max_inflight_tokens=args.batch_max_inflight_tokens,
                          cost_per_hour=args.cost_per_hour, usage_ledger=args.usage_ledger)
    engine = LLMEngine.from_args(serving_engine_args(args))
    state = make_state(engine, config)
    uv_config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                               timeout_graceful_shutdown=5, lifespan="off")
    return DrainingServer(uv_config, state, args.shutdown_timeout)


def serving_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine as served: without --max-prefill-tokens, steps take SERVING_PREFILL_TOKENS prompt tokens."""
    engine_args = engine_args_from(args)
    if engine_args.max_prefill_tokens is None:
        engine_args = dataclasses.replace(engine_args, max_prefill_tokens=SERVING_PREFILL_TOKENS)
    return engine_args


def _batch_dir(args: argparse.Namespace) -> str | None:
    """--batch-dir, else the default one, unless another server already holds the default (then no Batch API)."""
    if args.batch_dir is not None:
        return args.batch_dir
    from threefold.env import Env
    from threefold.server.serving_batch import batch_dir_in_use

    default = Env.read().home / "batches"
    if batch_dir_in_use(default):
        logger.warning("%s is in use by another server: this one serves no Batch API (give it --batch-dir)",
                       default)
        return None
    return str(default)


def run_server(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise SystemExit("--max-queued-requests must be at least 1")
    try:
        server = build_server(args)
    except ThreefoldError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    logger.info("serving %s on http://%s:%d", server.state.config.model_name, args.host, args.port)
    try:
        server.run()
    finally:
        if server.state.batch is not None:
            server.state.batch.stop()  # lines in flight are aborted and stay pending for the next start
        server.state.engine.shutdown()
    logger.info("server stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    quiet_openmp()
    parser = argparse.ArgumentParser(prog="threefold serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    # SIGTERM before uvicorn installs its handler (model still loading) exits cleanly too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.exit(main())
