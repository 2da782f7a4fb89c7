"""`threefold batch run -i input.jsonl -o output.jsonl`: a Batch API input file run without a server.

The same validation, the same handlers and the same line format as the
server's /v1/batches (vLLM's run_batch). Each line names its own url
(/v1/completions or /v1/chat/completions). Lines that succeed go to the
output file; failed and invalid ones to --error-file, or after the
successes in the output file when no error file is given.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from threefold.cli import add_engine_args, engine_args_from, quiet_openmp
from threefold.errors import ThreefoldError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("batch", help="run a Batch API input file (JSONL) without a server",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="batch_command", required=True)
    run = commands.add_parser("run", help="run every line of a batch input file")
    add_engine_args(run)
    run.add_argument("-i", "--input-file", required=True, help="JSONL, one request per line (OpenAI's format)")
    run.add_argument("-o", "--output-file", required=True, help="where the results go (JSONL)")
    run.add_argument("--error-file", default=None, help="where failed lines go (default: the output file)")
    run.add_argument("--served-model-name", nargs="+", default=None,
                     help="model name(s) the lines may use (default: --model)")
    run.add_argument("--max-inflight-tokens", type=int, default=65536,
                     help="estimated tokens of lines in the engine at once")
    parser.set_defaults(func=run_batch_file)
    return parser


def run_batch_file(args: argparse.Namespace) -> int:
    from threefold.engine.llm_engine import LLMEngine
    from threefold.server.app import make_state
    from threefold.server.config import ServerConfig

    data = _read_input(Path(args.input_file))
    engine = LLMEngine.from_args(engine_args_from(args))
    state = make_state(engine, ServerConfig(served_model_names=tuple(args.served_model_name or [args.model]),
                                            model_path=args.model))
    try:
        counts = asyncio.run(_run(state, data, args))
    finally:
        state.engine.shutdown()
    print(f"{counts['completed']} of {counts['total']} lines completed, {counts['failed']} failed",
          file=sys.stderr)
    return 0


def _read_input(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ThreefoldError(f"Cannot read the input file {path}: {exc.strerror}.", param="input_file") from exc


async def _run(state, data: bytes, args: argparse.Namespace) -> dict[str, int]:
    from tqdm import tqdm

    from threefold.batch.runner import BatchRunner, RunnerConfig
    from threefold.batch.store import BatchStore
    from threefold.batch.validate import BatchLimits
    from threefold.server.serving_batch import estimate_tokens, execute_line

    with tempfile.TemporaryDirectory(prefix="threefold-batch-") as tmp:
        store = BatchStore(tmp)
        progress = tqdm(desc="lines", unit="line", file=sys.stderr)
        runner = BatchRunner(store, lambda url, body: execute_line(state, url, body),
                             lambda url, body: estimate_tokens(state, body),
                             lambda model: model is None or model in state.config.served_model_names,
                             RunnerConfig(max_inflight_tokens=args.max_inflight_tokens),
                             BatchLimits(max_file_bytes=max(len(data), 1)), on_line=lambda ok: progress.update())
        file_id = store.add_file(data, Path(args.input_file).name, "batch")["id"]
        batch = runner.validate(store.create_batch(file_id, "", None))  # "": each line names its endpoint
        if batch.status == "failed":
            raise ThreefoldError(batch.errors["data"][0]["message"] if batch.errors else "The input is invalid.")
        progress.total = batch.request_counts["total"]
        await runner.run_lines(batch.id)
        batch = runner.finalize(batch.id)
        progress.close()
        _write_results(store, batch.output_file_id, batch.error_file_id, args)
        store.close()
    return batch.request_counts


def _write_results(store, output_id: str | None, error_id: str | None, args: argparse.Namespace) -> None:
    output = store.file_content(output_id) if output_id else b""
    errors = store.file_content(error_id) if error_id else b""
    if args.error_file is None:
        Path(args.output_file).write_bytes(output + errors)
        return
    Path(args.output_file).write_bytes(output)
    Path(args.error_file).write_bytes(errors)


def main(argv: list[str] | None = None) -> int:
    quiet_openmp()
    parser = argparse.ArgumentParser(prog="threefold")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ThreefoldError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
