"""The results store of a sweep: one SQLite database, one record per finished cell.

Layout of a store directory::

    results.sqlite          the records (readable with any SQLite client; schema below)
    lock                    held (flock) by the one driver writing the store; says who
    cells/<hash>/           per cell: its files -- for eval cells samples_<task>.jsonl (lm-eval's
                            per-document logs), trace/ (routing trace, on request) and
                            events.parquet (a hybrid cell's timeline, on request)

Guarantees:

* **A cell is absent or complete.** The cell's files are written first (atomically, see
  :mod:`moelab._output`), then its record in one SQLite transaction; a ``kill -9`` at any
  moment leaves either no record (the cell runs again) or a complete one.
* **Corrupt records are never counted.** Each record stores the sha256 of its JSON; a record
  whose checksum, JSON, key or files do not check out is reported and recomputed.
* **One writer.** A driver holds ``lock`` (``flock``) while it runs; a second driver on the
  same store is refused with the holder's pid, host and start time. A killed driver's lock
  is released by the kernel.
* **Versioned.** ``meta.schema_version``; a store written by a newer moelab is refused.
* **Failed runs change nothing.** A failed cell is logged in ``failures`` only; existing
  records are never rewritten except to replace one that failed its check.

Schema (``SCHEMA_VERSION`` 1)::

    meta(key TEXT PRIMARY KEY, value TEXT)            -- schema_version, created_by, ...
    cells(hash TEXT PRIMARY KEY, record TEXT, checksum TEXT, finished_at TEXT,
          model TEXT, policy TEXT, affected INTEGER, task TEXT, seed INTEGER,
          score REAL, score_stderr REAL, n_docs INTEGER)  -- record: the JSON of the cell
    failures(hash TEXT, attempt INTEGER, error TEXT, at TEXT, run_id TEXT)
    runs(run_id TEXT PRIMARY KEY, pid INTEGER, host TEXT, executor TEXT,
         started_at TEXT, ended_at TEXT, cells_done INTEGER, cells_failed INTEGER)
    fingerprints(signature TEXT PRIMARY KEY, model TEXT, fingerprint TEXT)

The columns beside ``record`` copy its headline fields for plain SQL; ``record`` (JSON) is
the truth: ``cell`` (the cell's settings and ``key``), ``metrics``/``stderr`` (lm-eval's
``metric,filter`` keys), ``primary_metric``, ``score``, ``score_stderr``, ``n_docs``,
``n_available``, ``notes``, ``versions``, ``wall_s``, ``worker``, ``started_at``,
``finished_at``, ``run_id``, ``cpu_s`` (the worker process's CPU seconds in the cell), ``samples_path``, ``trace_path`` and ``timeline_path``
(relative to the store; None where the cell has none: traces and timelines are recorded
when the spec's ``artifacts`` asks), ``latency`` (``{hardware profile: simulated
figures}``; empty until a simulator is registered). Records of the trace-based kinds
(``kind`` in ``cell``: ``cache``, ``predictor``) have the same headline fields: ``score`` is
the hit rate or the prediction accuracy, ``n_docs`` the accesses or (token, layer) pairs,
``metrics`` the full :class:`~moelab.caches.CacheResult` or prediction report; their
``model`` column is the trace's model, ``task`` the trace's directory name.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import logging
import os
import socket
import sqlite3
from pathlib import Path
from typing import Any

import moelab
from moelab._output import reserve_output
from moelab.errors import MoelabError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DB_NAME = "results.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS cells(hash TEXT PRIMARY KEY, record TEXT NOT NULL, checksum TEXT NOT NULL,
    finished_at TEXT, model TEXT, policy TEXT, affected INTEGER, task TEXT, seed INTEGER,
    score REAL, score_stderr REAL, n_docs INTEGER);
CREATE TABLE IF NOT EXISTS failures(hash TEXT, attempt INTEGER, error TEXT, at TEXT, run_id TEXT);
CREATE TABLE IF NOT EXISTS runs(run_id TEXT PRIMARY KEY, pid INTEGER, host TEXT, executor TEXT,
    started_at TEXT, ended_at TEXT, cells_done INTEGER, cells_failed INTEGER);
CREATE TABLE IF NOT EXISTS fingerprints(signature TEXT PRIMARY KEY, model TEXT, fingerprint TEXT);
"""


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Store:
    """A sweep's results store (see the module docstring). Open with :func:`open_store`."""

    def __init__(self, path: str | os.PathLike, *, writable: bool) -> None:
        self.path = Path(path).expanduser()
        self.writable = writable
        self._lock_fd: int | None = None
        self.run_id: str | None = None
        db = self.path / DB_NAME
        if writable:
            self._create_dir()
            self._acquire_lock()
            try:
                self.db = sqlite3.connect(db, isolation_level=None, timeout=30)
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=FULL")
                self._check_version(create=True)
            except BaseException:
                self.close()
                raise
        else:
            self.db = None
            if db.is_file():
                self.db = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None, timeout=30)
                if not self._has_tables():  # a driver is creating it this moment: nothing in it yet
                    self.db.close()
                    self.db = None
                else:
                    self._check_version(create=False)

    # ------------------------------------------------------------------ open/close
    def _create_dir(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise MoelabError(f"sweep store {str(self.path)!r} is a file; a store is a directory. "
                              "Choose another store path (spec key 'store' or --store).")
        try:
            (self.path / "cells").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MoelabError(f"cannot create sweep store {str(self.path)!r}: {exc.strerror}.") from None

    def _acquire_lock(self) -> None:
        lock = self.path / "lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise MoelabError(
                f"sweep store {str(self.path)!r} is in use by another driver ({self.lock_holder()}); "
                "wait for it to finish (or stop it), or use another store."
            ) from None
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": now()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        self._lock_fd = fd

    def lock_holder(self) -> str:
        try:
            info = json.loads((self.path / "lock").read_text())
            return f"pid {info['pid']} on {info['host']}, started {info['started_at']}"
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def _has_tables(self) -> bool:
        try:
            names = {n for (n,) in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as exc:
            raise MoelabError(f"{str(self.path / DB_NAME)!r} is not a readable sweep store ({exc}); "
                              "move it away to start a new store.") from None
        return {"meta", "cells"} <= names

    def _check_version(self, create: bool) -> None:
        if create:
            self.db.executescript(_SCHEMA)
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('created_by', ?)", (f"moelab {moelab.__version__}",))
        try:
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise MoelabError(f"{str(self.path / DB_NAME)!r} is not a readable sweep store ({exc}); "
                              "move it away to start a new store.") from None
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise MoelabError(
                f"sweep store {str(self.path)!r} has schema version {version}, written by a newer moelab "
                f"(this one reads up to {SCHEMA_VERSION}); upgrade moelab (pip install -U moelab) or use another store."
            )

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ runs
    def begin_run(self, executor: str) -> str:
        import uuid

        self.run_id = uuid.uuid4().hex[:12]
        self.db.execute("INSERT INTO runs VALUES (?,?,?,?,?,NULL,0,0)",
                        (self.run_id, os.getpid(), socket.gethostname(), executor, now()))
        return self.run_id

    def end_run(self, done: int, failed: int) -> None:
        self.db.execute("UPDATE runs SET ended_at=?, cells_done=?, cells_failed=? WHERE run_id=?",
                        (now(), done, failed, self.run_id))

    # ------------------------------------------------------------------ fingerprints
    def cached_fingerprint(self, signature: str) -> str | None:
        if self.db is None:
            return None
        row = self.db.execute("SELECT fingerprint FROM fingerprints WHERE signature=?", (signature,)).fetchone()
        return row[0] if row else None

    def cache_fingerprint(self, signature: str, model: str, fingerprint: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO fingerprints VALUES (?,?,?)", (signature, model, fingerprint))

    # ------------------------------------------------------------------ cells
    def cell_dir(self, cell_hash: str) -> Path:
        return self.path / "cells" / cell_hash

    def records(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """``(good, bad)``: the records that check out by hash, and why each bad one does not."""
        good: dict[str, dict[str, Any]] = {}
        bad: dict[str, str] = {}
        if self.db is None:
            return good, bad
        for cell_hash, text, digest in self.db.execute("SELECT hash, record, checksum FROM cells"):
            problem = self._problem(cell_hash, text, digest)
            if problem:
                bad[cell_hash] = problem
            else:
                good[cell_hash] = json.loads(text)
        return good, bad

    def _problem(self, cell_hash: str, text: Any, digest: Any) -> str | None:
        if not isinstance(text, str) or checksum(text) != digest:
            return "checksum mismatch"
        try:
            record = json.loads(text)
        except ValueError:
            return "record is not JSON"
        if not isinstance(record, dict) or record.get("cell", {}).get("hash") != cell_hash:
            return "record does not belong to its key"
        for key in ("metrics", "score", "n_docs", "finished_at"):
            if key not in record:
                return f"record lacks {key!r}"
        for name, rel in record.items():
            if name.endswith("_path") and rel and not (self.path / rel).exists():
                return f"its {name[:-5]} {rel!r} is missing"
        return None

    def put(self, record: dict[str, Any], files: dict[str, bytes | str]) -> None:
        """Write one finished cell: its files (atomically, into ``cells/<hash>/``), then its record.

        The record's ``*_path`` fields name files or folders relative to the cell's folder
        (``.`` for the folder itself; None: absent); they are stored relative to the store."""
        from moelab.sweeps.kinds import cell_from_dict

        cell = record["cell"]
        cell_hash = cell["hash"]
        target = self.cell_dir(cell_hash)
        if files:
            with reserve_output(target, overwrite=True, what="cell files") as out:
                for name, data in files.items():
                    rel = Path(name)
                    if rel.is_absolute() or ".." in rel.parts or not rel.parts or rel.parts[0].startswith("."):
                        raise MoelabError(f"unexpected cell file name {name!r} from a worker.")
                    (out.staging / rel).parent.mkdir(parents=True, exist_ok=True)
                    (out.staging / rel).write_bytes(data.encode() if isinstance(data, str) else data)
                out.commit()
            record.setdefault("samples_path", ".")
        for name in [k for k in record if k.endswith("_path")]:
            rel = record[name]
            if rel and files:
                record[name] = str((target / rel).relative_to(self.path)) if rel != "." else \
                    str(target.relative_to(self.path))
            elif rel:
                record[name] = None
        record["run_id"] = self.run_id
        cols = cell_from_dict(cell).columns()
        text = json.dumps(record, sort_keys=True, default=str)
        self.db.execute(
            "INSERT OR REPLACE INTO cells VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (cell_hash, text, checksum(text), record["finished_at"], cols["model"], cols["policy"],
             cols.get("affected"), cols["task"], cols.get("seed"), record["score"], record.get("score_stderr"),
             record["n_docs"]),
        )

    def record_failure(self, cell_hash: str, attempt: int, error: str) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.db.execute("INSERT INTO failures VALUES (?,?,?,?,?)", (cell_hash, attempt, error[-4000:], now(),
                                                                         self.run_id))

    def failures(self) -> dict[str, str]:
        """The last error of each cell that failed and has no good record."""
        if self.db is None:
            return {}
        return {h: e for h, e in self.db.execute("SELECT hash, error FROM failures ORDER BY rowid")}


def open_store(path: str | os.PathLike, *, writable: bool) -> Store:
    """Open a store to write (takes the lock, creates it) or to read (no lock; may not exist)."""
    return Store(path, writable=writable)
