"""Batch input checks, as OpenAI makes them.

Whole-request problems (purpose, completion_window, endpoint, file size, line
count) are a 400 naming the problem. A bad line (malformed JSON, no
custom_id, a duplicate custom_id, wrong method or url, unknown model) does
not stop the batch: it becomes an error-file line and the others run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from threefold.batch.store import Line, new_id
from threefold.errors import ThreefoldError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = ("24h",)


@dataclass(frozen=True)
class BatchLimits:
    max_file_bytes: int = 200 << 20
    """OpenAI's limit for a batch input file (200 MB)."""
    max_lines: int = 50_000
    """OpenAI's limit of requests per batch."""

    def __post_init__(self) -> None:
        if self.max_file_bytes < 1 or self.max_lines < 1:
            raise ThreefoldError(f"batch limits must be positive, got {self}.")


def check_upload(purpose: str | None, size: int, limits: BatchLimits) -> None:
    if purpose != "batch":
        raise ThreefoldError(f"Invalid purpose '{purpose}': this server accepts files with purpose 'batch' only.",
                             param="purpose")
    if size > limits.max_file_bytes:
        raise ThreefoldError(f"The file is {size} bytes, over the {limits.max_file_bytes}-byte limit for batch "
                             "input files.", param="file")
    if size == 0:
        raise ThreefoldError("The file is empty.", param="file")


def check_batch_request(endpoint: str, completion_window: str, purpose: str) -> None:
    if endpoint not in ENDPOINTS:
        raise ThreefoldError(f"Invalid endpoint '{endpoint}': batches support {', '.join(ENDPOINTS)}.",
                             param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise ThreefoldError(f"Invalid completion_window '{completion_window}': only '24h' is supported.",
                             param="completion_window")
    if purpose != "batch":
        raise ThreefoldError(f"The input file has purpose '{purpose}', not 'batch'.", param="input_file_id")


def error_result(custom_id: str | None, code: str, message: str) -> dict:
    """An error-file line for a line that was never run."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_lines(data: bytes, endpoint: str | None, model_ok: Callable[[str | None], bool],
                limits: BatchLimits) -> tuple[list[Line], dict[int, dict]]:
    """All non-blank lines, and the error-file line of each invalid one (by line index).

    `endpoint` None (the CLI) lets each line name either endpoint."""
    texts = [t for t in data.decode("utf-8", errors="replace").splitlines() if t.strip()]
    if not texts:
        raise ThreefoldError("The input file has no lines.", param="input_file_id")
    if len(texts) > limits.max_lines:
        raise ThreefoldError(f"The input file has {len(texts)} lines, over the limit of {limits.max_lines} "
                             "requests per batch.", param="input_file_id")
    lines, errors, seen = [], {}, set()
    for index, text in enumerate(texts):
        line, problem = _parse_line(index, text, endpoint, model_ok)
        if problem is None and line.custom_id in seen:
            message = f"The custom_id '{line.custom_id}' is used by an earlier line; custom_ids must be unique."
            problem = ("duplicate_custom_id", message)
        if problem is not None:
            errors[index] = error_result(line.custom_id, *problem)
            line.request = None
        seen.add(line.custom_id)
        lines.append(line)
    return lines, errors


def _parse_line(index: int, text: str, endpoint: str | None,
                model_ok: Callable[[str | None], bool]) -> tuple[Line, tuple[str, str] | None]:
    where = f"Line {index + 1}"
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        return Line(index, None, None), ("invalid_json", f"{where} is not valid JSON: {exc}.")
    if not isinstance(item, dict):
        return Line(index, None, None), ("invalid_request", f"{where} must be a JSON object.")
    custom_id = item.get("custom_id")
    line = Line(index, custom_id if isinstance(custom_id, str) else None, item)
    return line, _line_problem(where, item, endpoint, model_ok)


def _line_problem(where: str, item: dict, endpoint: str | None,
                  model_ok: Callable[[str | None], bool]) -> tuple[str, str] | None:
    if not isinstance(item.get("custom_id"), str) or not item["custom_id"]:
        return "missing_required_parameter", f"{where} has no custom_id (a non-empty string)."
    if item.get("method") != "POST":
        return "invalid_method", f"{where}: method must be 'POST', got {item.get('method')!r}."
    url = item.get("url")
    if url != endpoint if endpoint is not None else url not in ENDPOINTS:
        expected = endpoint or " or ".join(ENDPOINTS)
        return "invalid_url", f"{where}: url {url!r} does not match the batch's endpoint {expected}."
    body = item.get("body")
    if not isinstance(body, dict):
        return "invalid_request", f"{where}: body must be a JSON object."
    if body.get("stream"):
        return "invalid_request", f"{where}: streaming is not supported in a batch."
    if not model_ok(body.get("model")):
        return "model_not_found", f"{where}: the model {body.get('model')!r} does not exist."
    return None
