"""CPU ranks as processes: a reusable pool of gloo ranks on the loopback interface.

    with RankPool(4) as pool:
        results = pool.run(fn, *args)    # fn(rank, world_size, *args) on every rank, in parallel

``fn`` must be importable by name (a module-level function) and return picklable values.
Workers start once and run many jobs; they are forked from a server that imported torch and
Triton and ran the main kernels once (seconds each rank would pay again; ``_context``). Every
job is bounded: if any rank has not answered within ``timeout_s``, the pool terminates its own
worker processes and raises. Errors of any rank are re-raised in the caller as
:class:`RankError` with each failing rank's traceback. The rendezvous is a file store in a
private temporary directory, removed on close; gloo binds to ``lo`` only.
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

WORKER_ENV = {"TRITON_INTERPRET": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def _context():
    """How workers start: forked from multiprocessing's fork server, which imported torch, Triton
    and the kernels once and ran the main ones once (``moe_comm.testing.rank_preload``), so a
    rank is up
    in a fraction of a second instead of the seconds an import and the interpreter's first call
    of a kernel cost each process; ``spawn`` where there is no fork server. The server starts
    with the first pool of this process and ends with it."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["moe_comm.testing.rank_preload"])
    return ctx


@contextlib.contextmanager
def _environment(env: dict | None):
    """This process's environment is ``env`` inside (a spawned child starts with it, and
    Triton decides at import whether a kernel compiles or is interpreted); None: unchanged."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class RankError(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank -> (exception type name, message)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]):
        self.errors = {r: (kind, msg) for r, (kind, msg, _) in errors.items()}
        first = min(errors)
        lines = [f"rank {r}: {kind}: {msg}" for r, (kind, msg, _) in sorted(errors.items())]
        super().__init__("\n".join(lines) + f"\n--- traceback of rank {first} ---\n"
                         + errors[first][2])


def _worker(rank: int, world_size: int, store_path: str, conn, env: dict,
            pg_timeout_s: float) -> None:
    os.environ.clear()  # the caller's environment as it is now (the fork server's is older)
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        while True:
            job = conn.recv()
            if job is None:
                break
            fn, args, kwargs = job
            try:
                conn.send(("ok", fn(rank, world_size, *args, **kwargs)))
            except BaseException as error:  # reported to the caller, the worker lives on
                conn.send(("error", (type(error).__name__, str(error), traceback.format_exc())))
    finally:
        dist.destroy_process_group()
        conn.close()


class RankPool:
    """``world_size`` worker processes joined in one gloo process group."""

    def __init__(self, world_size: int, *, env: dict | None = None, timeout_s: float = 600.0,
                 pg_timeout_s: float = 120.0, compiled: bool = False):
        """``compiled``: the ranks launch compiled kernels (GPU processes, which may share one
        device): spawned, not forked from the interpreter's fork server, with
        ``TRITON_INTERPRET=0``."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        self._dir = tempfile.mkdtemp(prefix="moe_comm_pool_")
        ctx = mp.get_context("spawn") if compiled else _context()
        mode = {"TRITON_INTERPRET": "0"} if compiled else {}
        worker_env = {**os.environ, **WORKER_ENV, **mode, **(env or {})}
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, daemon=True, name=f"moe_comm-rank{rank}",
                               args=(rank, world_size, os.path.join(self._dir, "store"), child,
                                     worker_env, pg_timeout_s))
            with _environment(worker_env if compiled else None):
                proc.start()  # (spawned: the kernels are made as it imports, in this env)
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.closed = False

    def run(self, fn: Callable, *args, timeout_s: float | None = None,
            may_die: tuple[int, ...] = (), **kwargs) -> list[Any]:
        """``[fn(rank, world_size, *args, **kwargs) for every rank]``, run concurrently.

        ``may_die``: ranks whose process may end during the job (fault-tolerance tests kill
        them): their result is None instead of an error; the pool is then unhealthy."""
        if self.closed:
            raise RuntimeError("the RankPool is closed")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        while len(results) + len(errors) < self.world_size:
            waiting = [r for r in range(self.world_size) if r not in results and r not in errors]
            for r in waiting:
                if self._conns[r].poll(0.01):
                    try:
                        status, value = self._conns[r].recv()
                    except EOFError:
                        status, value = "error", ("EOFError", "worker exited", "")
                        if r in may_die:
                            status, value = "ok", None
                    (results if status == "ok" else errors)[r] = value
                elif not self._procs[r].is_alive():
                    if r in may_die:
                        results[r] = None
                    else:
                        errors[r] = ("WorkerDied", f"exit code {self._procs[r].exitcode}", "")
            if time.monotonic() > deadline:
                self.close(force=True)
                raise TimeoutError(f"ranks {waiting} did not finish {fn.__name__} in time; "
                                   "the pool was terminated")
        if errors:
            raise RankError(errors)
        return [results[r] for r in range(self.world_size)]

    def healthy(self) -> bool:
        return not self.closed and all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        """Stops the workers (terminating them if they do not exit) and removes the store."""
        if self.closed:
            return
        self.closed = True
        if not force:
            for conn, proc in zip(self._conns, self._procs):
                if proc.is_alive():
                    try:
                        conn.send(None)
                    except (BrokenPipeError, OSError):
                        pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 20)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parallel_launch(world_size: int, fn: Callable, *args, **kwargs) -> list[Any]:
    """Starts ``world_size`` ranks, runs ``fn(rank, world_size, *args)`` on each, shuts down."""
    with RankPool(world_size) as pool:
        return pool.run(fn, *args, **kwargs)


def run_ranks(world_size: int, fn: Callable, *args) -> dict[int, Any]:
    """``{rank: fn(rank, world_size, *args)}`` for the ranks of this process: under torchrun
    (``RANK`` set) this process's own rank over gloo; otherwise ``world_size`` ranks started
    here. The entry point of the examples."""
    if "RANK" not in os.environ:
        return dict(enumerate(parallel_launch(world_size, fn, *args)))
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        return {rank: fn(rank, dist.get_world_size(), *args)}
    finally:
        dist.destroy_process_group()
