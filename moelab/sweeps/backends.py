"""Sweep backends: where cells run. The driver stays the single writer of the store.

(Called backends, not executors: an *executor* is what runs a hybrid run's plans,
:mod:`moelab.hybrid.executors`.)

* :class:`LocalBackend` runs cells one after another in the driver's process.
* :class:`RayBackend` runs them on Ray actors (one per worker, each keeping its model
  loaded across cells and its torch threads pinned); a local cluster by default, an
  existing one with ``address``. ``ray`` is imported only here, when it is used.

Both call ``on_done(cell, output)`` for each finished cell (in the driver's process) and
``on_failed(cell, attempt, error, final)`` for each failed attempt; a cell is tried
``1 + retries`` times before it is reported as failed.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

import moelab
from moelab.errors import MoelabError, unknown_name
from moelab.sweeps.spec import Cell

log = logging.getLogger(__name__)

OnDone = Callable[[Cell, dict[str, Any]], None]
OnFailed = Callable[[Cell, int, str, bool], None]
OnStart = Callable[[Cell], None]

RAY_INSTALL = 'pip install "moelab[ray]"  (or: pip install ray==2.60.0)'
SWEEP_BACKENDS = ("local", "ray")


class LocalBackend:
    """Cells in order, in this process, on one :class:`~moelab.sweeps.worker.CellRunner`."""

    name = "local"

    def __init__(self, threads: int | None = None, preload: dict[tuple, Any] | None = None) -> None:
        self.threads = threads
        self.workers = 1
        self.preload = preload
        """``cell.resource()`` → an object already loaded (see :class:`~moelab.sweeps.worker.CellRunner`)."""

    def run(self, cells: list[Cell], retries: int, on_start: OnStart, on_done: OnDone,
            on_failed: OnFailed) -> None:
        from moelab.sweeps.worker import CellRunner

        runner = CellRunner(self.threads, name="local", preload=self.preload)
        for cell in cells:
            for attempt in range(1, retries + 2):
                on_start(cell)
                try:
                    out = runner.run(cell)
                except MoelabError as exc:  # bad settings for this model: retrying cannot help
                    on_failed(cell, attempt, str(exc), True)
                    break
                except Exception:  # noqa: BLE001 - reported per cell, the sweep goes on
                    on_failed(cell, attempt, traceback.format_exc(), attempt > retries)
                    continue
                on_done(cell, out)
                break


def import_ray():
    try:
        import ray
    except ImportError:
        raise MoelabError(f"--backend ray needs the 'ray' package, which is not installed; install it with: "
                          f"{RAY_INSTALL}") from None
    return ray


class RayBackend:
    """Cells on ``workers`` Ray actors (see the module docstring)."""

    name = "ray"

    def __init__(self, workers: int = 2, address: str | None = None, threads: int | None = None) -> None:
        if workers < 1:
            raise MoelabError(f"workers={workers}: expected at least 1.")
        self.workers = workers
        self.address = address
        self.threads = threads
        self.ray = import_ray()
        if address:  # before the store is taken; ray.init waits minutes for an address nobody answers at
            _check_reachable(address)
        self.actors_start_s: float | None = None
        self.keep = False
        """Keep the actors (and cluster) after :meth:`run`; :meth:`close` stops them."""

    def _init(self) -> bool:
        """Connect to (or start) a cluster; True when this call started it."""
        ray = self.ray
        if ray.is_initialized():
            return False
        import os

        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "configure_logging": False}
        if not self.address:
            # local actors import moelab from where the driver does (a checkout on sys.path included);
            # they inherit this environment (a runtime_env would start a slower, separate worker pool)
            root = _moelab_root()
            paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if root not in paths:
                os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [root, *paths] if p)
        if self.address:
            kwargs["address"] = self.address
            _token_auth_if_available()
        else:
            # "local": always a new cluster of our own; without it ray.init joins whatever cluster
            # /tmp/ray/ray_current_cluster names (a stale one from a killed run included)
            kwargs["address"] = "local"
            kwargs["num_cpus"] = self.workers * (self.threads or 1)
        try:
            try:
                ray.init(**kwargs)
            except Exception as exc:  # noqa: BLE001 - a local cluster that started too slowly: once more
                if self.address or "timed out during startup" not in str(exc):
                    raise
                log.warning("Ray local cluster did not start within Ray's 30 s (%s); trying once more", exc)
                ray.shutdown()
                ray.init(**kwargs)
        except ConnectionError as exc:
            raise MoelabError(f"cannot connect to the Ray cluster at {self.address!r} ({exc}); check the "
                              "address (ray start --head prints it) or leave --address out for a local cluster.") from None
        except Exception as exc:  # Ray raises a bare Exception when its processes start too slowly
            if self.address or "timed out during startup" not in str(exc):
                raise
            raise MoelabError(f"Ray local cluster did not start ({exc}); the machine may be overloaded: "
                              "run again, or start one with `ray start --head` and pass --address.") from None
        return True

    def start(self, n: int | None = None) -> None:
        """Connect to (or start) the cluster and start ``n`` (default ``workers``) actors, each
        importing the evaluation stack before its first cell. :meth:`run` calls it when needed."""
        from moelab.sweeps.worker import CellRunner

        ray = self.ray
        self._started_cluster = self._init() or getattr(self, "_started_cluster", False)
        try:
            threads = self.threads or 1
            self._actor_cls = ray.remote(num_cpus=threads, max_restarts=0)(CellRunner)
            n = n or self.workers
            t0 = time.perf_counter()
            self._actors = [self._actor_cls.remote(threads, f"ray-{i}") for i in range(n)]
            for info in ray.get([a.warm.remote() for a in self._actors]):  # up, lm-eval imported, before any cell
                log.info("worker %s: pid %s on %s, %s torch thread(s)", info["worker"], info["pid"], info["host"],
                         info["threads"])
        except BaseException:
            # no actors and no connection left behind: a driver still connected when its cluster stops is
            # terminated by Ray 60 s later (the whole process, a notebook kernel or a test worker included)
            with contextlib.suppress(Exception):  # the original error is the one to report
                self.close()
            raise
        self.actors_start_s = time.perf_counter() - t0
        self._loaded: list[tuple | None] = [None] * n

    def close(self) -> None:
        """Stop the actors, and disconnect from (or stop) the cluster if this backend joined or started it;
        the disconnect happens even when killing an actor fails."""
        try:
            for a in getattr(self, "_actors", None) or []:
                try:
                    self.ray.kill(a)
                except Exception as exc:  # noqa: BLE001 - a dead cluster: the disconnect below matters more
                    log.warning("could not kill a Ray actor (%s)", exc)
        finally:
            self._actors = None
            if getattr(self, "_started_cluster", False):
                self._started_cluster = False
                self.ray.shutdown()

    def run(self, cells: list[Cell], retries: int, on_start: OnStart, on_done: OnDone,
            on_failed: OnFailed) -> None:
        """Run ``cells`` on the actors (started here unless :meth:`start` was called; stopped at
        the end unless ``keep`` is set, e.g. by a benchmark timing warm actors)."""
        if not cells:
            return
        ray = self.ray
        if getattr(self, "_actors", None) is None:
            self.start(min(self.workers, len(cells)))  # closes what it opened when it fails
        actors, loaded, threads = self._actors, self._loaded, self.threads or 1
        n = len(actors)
        queue: list[tuple[Cell, int]] = [(c, 1) for c in cells]
        pending: dict[Any, tuple[int, Cell, int]] = {}
        try:
            while queue or pending:
                for i in range(n):
                    if queue and all(slot != i for slot, _, _ in pending.values()):
                        # prefer a cell whose model this actor already holds
                        j = next((k for k, (c, _) in enumerate(queue) if c.resource() == loaded[i]), 0)
                        cell, attempt = queue.pop(j)
                        on_start(cell)
                        pending[actors[i].run.remote(cell.to_dict())] = (i, cell, attempt)
                        loaded[i] = cell.resource()
                # blocks in Ray's C++ core (no polling in Python): the driver idles while cells run
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    i, cell, attempt = pending.pop(ref)
                    try:
                        out = ray.get(ref)
                    except ray.exceptions.RayActorError as exc:  # the worker died: a new one
                        actors[i], loaded[i] = self._actor_cls.remote(threads, f"ray-{i}"), None
                        actors[i].warm.remote()
                        self._failed(cell, attempt, f"worker died: {exc}", retries, queue, on_failed)
                    except ray.exceptions.RayTaskError as exc:
                        cause = getattr(exc, "cause", None)
                        if isinstance(cause, MoelabError):
                            on_failed(cell, attempt, str(cause), True)
                        else:
                            self._failed(cell, attempt, str(exc), retries, queue, on_failed)
                    else:
                        on_done(cell, out)
        finally:
            if not self.keep:
                self.close()

    @staticmethod
    def _failed(cell: Cell, attempt: int, error: str, retries: int, queue: list, on_failed: OnFailed) -> None:
        final = attempt > retries
        on_failed(cell, attempt, error, final)
        if not final:
            queue.insert(0, (cell, attempt + 1))


def _refresh_ray_config() -> None:
    """Ray reads its configuration once per process: re-read it, as ``ray start``'s own switch to
    token mode does."""
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception as exc:  # noqa: BLE001 - a Ray without it reads the variable when it starts
        log.debug("Ray's Config.initialize is not available (%s)", exc)


def _token_auth_if_available() -> bool:
    """Ray's own rule for ``ray start``, applied to this driver before it joins a cluster: with
    ``RAY_AUTH_MODE`` unset and a token available (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``), use token authentication. Ray 2.60's ``ray start --head`` turns it on
    whenever such a token exists, but ``ray.init(address=...)`` sends the token only in token mode,
    so every call was refused (``InvalidAuthToken``) until ray.init gave up; a cluster without
    authentication accepts a token-mode driver too (both checked 2026-11-27). True when it turned
    token mode on (for this process and the workers it starts)."""
    import os
    from pathlib import Path

    if os.environ.get("RAY_AUTH_MODE") is not None:
        return False
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not (os.environ.get("RAY_AUTH_TOKEN") or (path and Path(path).is_file())
            or (Path.home() / ".ray" / "auth_token").is_file()):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    _refresh_ray_config()
    log.info("Ray: a token is available and RAY_AUTH_MODE is unset; joining the cluster with token authentication "
             "(set RAY_AUTH_MODE=disabled to opt out)")
    return True


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Refuse a ``HOST:PORT`` address where nothing accepts connections (``auto`` and
    ``ray://`` addresses are left to Ray)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise MoelabError(f"cannot connect to the Ray cluster at {address!r} ({exc.strerror or exc}); check the "
                          "address (ray start --head prints it) or leave --address out for a local cluster.") from None


def _moelab_root() -> str:
    from pathlib import Path

    return str(Path(moelab.__file__).resolve().parent.parent)


def make_backend(name: str, workers: int = 1, address: str | None = None,
                  threads: int | None = None) -> LocalBackend | RayBackend:
    if name == "local":
        if workers != 1:
            raise MoelabError(f"--workers {workers} needs --backend ray; the local backend runs one cell at a time.")
        if address:
            raise MoelabError("--address is for --backend ray.")
        return LocalBackend(threads)
    if name == "ray":
        return RayBackend(workers, address, threads)

    raise unknown_name("sweep backend", name, SWEEP_BACKENDS)
