"""Candidates built and warmed up in parallel, then timed one at a time.

A GPU stage compares several candidates (models, layers, decoding paths), each of which first
compiles: one inductor compile of TokenFormer-150M's training step took 66 s on the H200, so five
of them one after another would take most of a lease. Here each candidate lives in a process of
its own (``spawn``): all are built and compiled at once (the GPU's memory holds them; inductor's
compile threads are shared out among them), then the parent asks one process at a time to run and
time a call, round-robin, so that no two candidates ever share the GPU while timed. A candidate
whose process fails (a CUDA error, out of memory) or is not ready by the deadline is dropped with
its error; the others go on.

A candidate is an object a module-level factory returns (``factory(**kwargs)``, in the worker);
the parent calls its methods by name with picklable arguments and gets picklable results.
``processes=False`` builds every candidate in this process instead, one after another (a CPU, the
smoke runs: the same calls, no parallel compiles). This module imports no torch itself: a worker
loads only what its candidate needs.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any


class WorkerError(RuntimeError):
    """A candidate failed (its message says how); its worker is dropped."""


@dataclass
class Worker:
    key: str
    process: Any = None  # multiprocessing's process, when the candidate lives in one
    conn: Connection | None = None
    candidate: Any = None  # the candidate itself, when it lives in this process
    info: dict[str, Any] | None = None  # what the factory's candidate reports once ready
    error: str | None = None


def _serve(conn: Connection, factory: Callable[..., Any], kwargs: dict[str, Any],
           backend: str) -> None:
    """A worker process: build the candidate, say ``ready`` with its info, then run the
    methods the parent names until told to stop (or interrupted: SIGINT ends it)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with compile_backend(backend):
        try:
            candidate = factory(**kwargs)
            conn.send(("ready", getattr(candidate, "info", {})))
        except Exception as exc:  # the parent records it and drops this worker
            conn.send(("error", _describe(exc)))
            return
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, KeyboardInterrupt):
                return
            if method is None:
                return
            try:
                conn.send(("ok", getattr(candidate, method)(*args)))
            except Exception as exc:  # likewise
                conn.send(("error", _describe(exc)))


def _describe(exc: BaseException) -> str:
    traceback.print_exc()  # the whole traceback to the stage's log
    return f"{type(exc).__name__}: {str(exc).strip()[:400]}"


class Pool:
    """One worker per candidate (``specs``: key → (factory, kwargs)); a context manager that
    stops every worker it started."""

    def __init__(self, specs: dict[str, tuple[Callable[..., Any], dict[str, Any]]], *,
                 processes: bool, backend: str = "inductor") -> None:
        self.specs, self.processes, self.backend = specs, processes, backend
        self.workers = {key: Worker(key) for key in specs}

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ready(self) -> list[str]:
        """The keys of the candidates built and not failed, in the specs' order."""
        return [k for k, w in self.workers.items() if w.info is not None and w.error is None]

    def errors(self) -> dict[str, str]:
        return {k: w.error for k, w in self.workers.items() if w.error}

    def start(self, deadline: float, label: str) -> None:
        """Build every candidate (in parallel with ``processes``) until ``deadline`` (monotonic):
        those not ready by then are dropped. Says how many were ready how soon (``label``: the
        stage)."""
        began = time.perf_counter()
        self._start(deadline)
        print(f"{label}: {len(self.ready())} of {len(self.specs)} ready in "
              f"{time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)

    def _start(self, deadline: float) -> None:
        if not self.processes:
            with compile_backend(self.backend):
                for key, (factory, kwargs) in self.specs.items():
                    if time.monotonic() > deadline:
                        self.workers[key].error = "not built: the stage's time was spent"
                        continue
                    try:
                        candidate = factory(**kwargs)
                    except Exception as exc:
                        self.workers[key].error = _describe(exc)
                        continue
                    self.workers[key].candidate = candidate
                    self.workers[key].info = getattr(candidate, "info", {})
            return
        context = multiprocessing.get_context("spawn")
        with _compile_threads(len(self.specs)):
            for key, (factory, kwargs) in self.specs.items():
                parent, child = context.Pipe()
                process = context.Process(target=_serve, name=f"gpu-{key}",
                                          args=(child, factory, kwargs, self.backend))
                process.start()
                child.close()
                self.workers[key].process, self.workers[key].conn = process, parent
        waiting = {w.conn: w for w in self.workers.values()}
        while waiting and time.monotonic() < deadline:
            for conn in wait(list(waiting), timeout=until(deadline)):
                worker = waiting.pop(conn)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    status, payload = "error", "the worker process died while building"
                if status == "ready":
                    worker.info = payload
                else:
                    self._drop(worker, payload)
        for worker in waiting.values():
            self._drop(worker, "not ready by the stage's deadline (still building/compiling)")

    def call(self, key: str, method: str, *args: Any, timeout: float | None = None) -> Any:
        """``candidate.method(*args)`` of ``key``'s candidate; WorkerError (and the worker
        dropped) when it fails or its process dies or outlasts ``timeout``."""
        worker = self.workers[key]
        if worker.error is not None:
            raise WorkerError(worker.error)
        if worker.conn is None:
            try:
                return getattr(worker.candidate, method)(*args)
            except Exception as exc:
                worker.error = _describe(exc)
                raise WorkerError(worker.error) from exc
        try:
            worker.conn.send((method, args))
            if not worker.conn.poll(timeout):
                raise TimeoutError(f"{method} took longer than {timeout:.0f} s")
            status, payload = worker.conn.recv()
        except (EOFError, OSError, TimeoutError) as exc:
            status, payload = "error", f"{type(exc).__name__}: {exc} (the worker is dropped)"
        if status != "ok":
            self._drop(worker, payload)
            raise WorkerError(payload)
        return payload

    def _drop(self, worker: Worker, error: str) -> None:
        worker.error = error
        print(f"workers: {worker.key}: {error}", file=sys.stderr, flush=True)
        self._stop(worker)

    def _stop(self, worker: Worker) -> None:
        if worker.process is None:
            worker.candidate = None
            return
        with contextlib.suppress(OSError, ValueError):
            worker.conn.send((None, ()))
        worker.process.join(timeout=5)
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join(timeout=5)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.process = None

    def close(self) -> None:
        for worker in self.workers.values():
            self._stop(worker)


@contextlib.contextmanager
def compile_backend(backend: str) -> Iterator[None]:
    """torch.compile with ``backend`` everywhere it is called inside the block (fit's own call
    included): ``eager`` traces with dynamo only, which keeps --smoke fast on a CPU."""
    if backend == "inductor":  # torch.compile's own default: nothing to change (or import)
        yield
        return
    import torch

    original = torch.compile
    torch.compile = functools.partial(original, backend=backend)
    try:
        yield
    finally:
        torch.compile = original


@contextlib.contextmanager
def _compile_threads(workers: int) -> Iterator[None]:
    """Inductor's compile threads shared out among ``workers`` processes compiling at once (each
    would otherwise start one per core): the variable the spawned workers read at import."""
    name = "TORCHINDUCTOR_COMPILE_THREADS"
    before = os.environ.get(name)
    if before is None:
        os.environ[name] = str(max(1, (os.cpu_count() or 1) // max(1, workers)))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)


def until(deadline: float, slack: float = 0.0) -> float | None:
    """Seconds from now to ``deadline`` plus ``slack`` (at least 1; None without a deadline)."""
    return None if math.isinf(deadline) else max(1.0, deadline - time.monotonic() + slack)


def interleave(pool: Pool, calls: dict[Any, tuple[str, str, tuple]], rounds: int, warmup: int,
               deadline: float) -> tuple[dict[Any, dict[str, float]], dict[Any, str]]:
    """Seconds per call of each ``calls`` entry (key → (worker, method, args); the method times
    itself and returns seconds), round-robin with the order rotated each round as
    ``common.interleaved`` does, after ``warmup`` untimed rounds: ``{key: {"min", "median",
    "rounds"}}``, and the calls that failed with their errors. Stops early (keeping the rounds
    done, at least one) at ``deadline``."""
    keys = list(calls)
    times: dict[Any, list[float]] = {k: [] for k in keys}
    errors: dict[Any, str] = {}
    for i in range(warmup + rounds if keys else 0):
        if i > warmup and time.monotonic() > deadline:
            break
        for key in keys[i % len(keys):] + keys[:i % len(keys)]:
            worker, method, args = calls[key]
            if key in errors or pool.workers[worker].error:
                errors.setdefault(key, pool.workers[worker].error or "")
                continue
            try:  # a call that hangs is given up at the deadline (and its worker dropped)
                seconds = pool.call(worker, method, *args, timeout=until(deadline, 10))
            except WorkerError as exc:
                errors[key] = str(exc)
                continue
            if i >= warmup:
                times[key].append(seconds)
    return ({k: {"min": min(t), "median": statistics.median(t), "rounds": len(t)}
             for k, t in times.items() if t and k not in errors}, errors)
