"""Durable Batch API state: SQLite (WAL) for files, batches and per-line results, plus a files directory.

    <root>/batch.db        files, batches, lines (one row per input line)
    <root>/files/<id>      the bytes of each file (uploads, outputs, error files)

A line's result is committed the moment it finishes, so a crash loses no
finished line; a restart runs only lines still `pending`. (batch_id,
line_index) is the key, and a result is written only over a pending row, so
every line is reported exactly once however often the batch is resumed.
One connection, serialised by a lock: the HTTP handlers and the batch runner
live on different threads.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from threefold.errors import ThreefoldError

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
FINISHED_STATUSES = ("completed", "failed", "expired", "cancelled")
COMPLETION_WINDOW_S = 24 * 3600

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, bytes INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, body TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_index INTEGER NOT NULL, custom_id TEXT, request TEXT,
    done INTEGER NOT NULL DEFAULT 0, ok INTEGER, result TEXT,
    PRIMARY KEY (batch_id, line_index));
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, done);
"""


class NotFoundError(ThreefoldError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param, status_code=404)


@dataclass
class Line:
    """One input line as the runner sees it: a request to run, or (request None) an invalid line."""

    index: int
    custom_id: str | None
    request: dict | None
    """{"method", "url", "body"}; None when the line failed validation."""
    error: dict | None = None
    """{"code", "message"} for a line that failed validation."""


@dataclass
class Batch:
    """A batch as OpenAI describes it; `to_dict()` is the API object."""

    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    created_at: int
    metadata: dict | None = None
    timestamps: dict[str, int | None] = field(default_factory=dict)
    request_counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        stamps = {k: self.timestamps.get(k) for k in (
            "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
            "cancelling_at", "cancelled_at")}
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": self.errors,
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, **stamps, "request_counts": dict(self.request_counts),
                "metadata": self.metadata}

    @classmethod
    def from_json(cls, text: str) -> Batch:
        return cls(**json.loads(text))

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__dataclass_fields__})


def file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class BatchStore:
    """Files, batches and line results under one directory; safe to share between threads."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.root / "batch.db", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a committed row survives a process crash (SIGKILL); only power loss can undo the last ones.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> _Transaction:
        return _Transaction(self)

    # ---- files -----------------------------------------------------------

    def add_file(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = new_id("file-")
        tmp = self.files_dir / f".{file_id}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.files_dir / file_id)  # the row only ever points at complete bytes
        with self._tx() as db:
            db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?)", (file_id, len(data), filename, purpose,
                                                                    int(time.time())))
        return self.get_file(file_id)

    def get_file(self, file_id: str) -> dict[str, Any]:
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No such file: '{file_id}'.", param="file_id")
        return file_object(row)

    def list_files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM files WHERE ?1 IS NULL OR purpose = ?1 "
                                    "ORDER BY created_at DESC, rowid DESC", (purpose,)).fetchall()
        return [file_object(row) for row in rows]

    def file_content(self, file_id: str) -> bytes:
        self.get_file(file_id)
        return (self.files_dir / file_id).read_bytes()

    def delete_file(self, file_id: str) -> dict[str, Any]:
        self.get_file(file_id)
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        (self.files_dir / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches ---------------------------------------------------------

    def create_batch(self, input_file_id: str, endpoint: str, metadata: dict | None) -> Batch:
        now = int(time.time())
        batch = Batch(id=new_id("batch_"), input_file_id=input_file_id, endpoint=endpoint, completion_window="24h",
                      status="validating", created_at=now, metadata=metadata,
                      timestamps={"expires_at": now + COMPLETION_WINDOW_S})
        with self._tx() as db:
            db.execute("INSERT INTO batches VALUES (?, ?, ?, ?)", (batch.id, batch.to_json(), batch.status, now))
        return batch

    def get_batch(self, batch_id: str) -> Batch:
        with self._lock:
            row = self._db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No such batch: '{batch_id}'.", param="batch_id")
        return Batch.from_json(row["body"])

    def list_batches(self, after: str | None = None, limit: int = 20) -> list[Batch]:
        with self._lock:
            rows = self._db.execute("SELECT id, body FROM batches ORDER BY created_at DESC, rowid DESC").fetchall()
        ids = [row["id"] for row in rows]
        start = ids.index(after) + 1 if after in ids else 0
        return [Batch.from_json(row["body"]) for row in rows[start:start + limit]]

    def active_batch_ids(self) -> list[str]:
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY created_at, rowid",
                                    ACTIVE_STATUSES).fetchall()
        return [row["id"] for row in rows]

    def set_status(self, batch_id: str, status: str, **changes: Any) -> Batch:
        """Move a batch to `status`, stamping `<status>_at`; other Batch fields may change with it."""
        with self._tx() as db:
            batch = self.get_batch(batch_id)
            batch.status = status
            batch.timestamps[f"{status}_at"] = int(time.time())
            for name, value in changes.items():
                setattr(batch, name, value)
            db.execute("UPDATE batches SET body = ?, status = ? WHERE id = ?", (batch.to_json(), status, batch_id))
        return batch

    def cancel_batch(self, batch_id: str) -> Batch:
        """validating/in_progress -> cancelling, atomically (the runner may be finishing it right now)."""
        with self._tx():
            batch = self.get_batch(batch_id)
            if batch.status in ("cancelling", "cancelled"):
                return batch
            if batch.status not in ("validating", "in_progress"):
                raise ThreefoldError(f"Cannot cancel batch {batch_id}: it is already {batch.status}.",
                                     param="batch_id")
            return self.set_status(batch_id, "cancelling")

    # ---- lines -----------------------------------------------------------

    def start_batch(self, batch_id: str, lines: list[Line], results: dict[int, dict]) -> Batch:
        """Store the validated lines (invalid ones already done, with their error) and go in_progress.

        Idempotent: a batch interrupted while validating is validated again from scratch."""
        with self._tx() as db:
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?, ?, ?, ?)", [
                (batch_id, line.index, line.custom_id, json.dumps(line.request) if line.request else None,
                 int(line.index in results), 0 if line.index in results else None,
                 json.dumps(results[line.index]) if line.index in results else None) for line in lines])
            counts = {"total": len(lines), "completed": 0, "failed": len(results)}
            status = self.get_batch(batch_id).status  # a cancel may have come in while validating
            return self.set_status(batch_id, "in_progress" if status == "validating" else status,
                                   request_counts=counts)

    def pending_lines(self, batch_id: str) -> list[Line]:
        with self._lock:
            rows = self._db.execute("SELECT line_index, custom_id, request FROM lines WHERE batch_id = ? AND "
                                    "done = 0 ORDER BY line_index", (batch_id,)).fetchall()
        return [Line(row["line_index"], row["custom_id"], json.loads(row["request"])) for row in rows]

    def record_result(self, batch_id: str, index: int, ok: bool, result: dict) -> bool:
        """Commit one finished line; False (and nothing written) if it was already done."""
        with self._tx() as db:
            cursor = db.execute("UPDATE lines SET done = 1, ok = ?, result = ? WHERE batch_id = ? AND "
                                "line_index = ? AND done = 0", (int(ok), json.dumps(result), batch_id, index))
            if cursor.rowcount == 0:
                return False
            batch = self.get_batch(batch_id)
            batch.request_counts["completed" if ok else "failed"] += 1
            db.execute("UPDATE batches SET body = ? WHERE id = ?", (batch.to_json(), batch_id))
        return True

    def results(self, batch_id: str) -> Iterator[tuple[bool, dict]]:
        """(ok, result line) of every finished line, in input order."""
        with self._lock:
            rows = self._db.execute("SELECT ok, result FROM lines WHERE batch_id = ? AND done = 1 "
                                    "ORDER BY line_index", (batch_id,)).fetchall()
        for row in rows:
            yield bool(row["ok"]), json.loads(row["result"])

    def num_pending(self) -> int:
        """Lines of active batches not run yet: the offline queue."""
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        with self._lock:
            row = self._db.execute(f"SELECT COUNT(*) FROM lines JOIN batches ON batches.id = lines.batch_id "
                                   f"WHERE done = 0 AND batches.status IN ({marks})", ACTIVE_STATUSES).fetchone()
        return int(row[0])


class _Transaction:
    """`with store._tx() as db:` one IMMEDIATE transaction under the store's lock (re-entrant: nested = no-op)."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self.outer = False

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        self.outer = not self.store._db.in_transaction
        if self.outer:
            self.store._db.execute("BEGIN IMMEDIATE")
        return self.store._db

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            if self.outer:
                self.store._db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.store._lock.release()
