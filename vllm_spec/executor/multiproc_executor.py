"""Tensor parallelism on one machine: one spawned worker process per rank, torch.distributed between them.

The engine's process is the driver: it pickles each step's ExecuteModelRequest once and sends the
same bytes to every rank over its pipe; every rank runs the step (the collectives keep them in
lock step) and rank 0 sends back the StepOutput. While it waits, the driver also watches every
rank's process: a rank that dies or reports an error fails the step at once with a clear
WorkerError (the other ranks, stuck in a collective, are then stopped), and every later step
fails the same way, so the engine fails its in-flight requests instead of hanging.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
import weakref
from multiprocessing.connection import Connection, wait

from vllm_spec.config import EngineConfig
from vllm_spec.executor.base import RankExecutor, WorkerError
from vllm_spec.executor.rank_worker import kv_blocks_for_ranks, run_rank_process
from vllm_spec.worker.batch import ExecuteModelRequest, StepOutput


class MultiprocExecutor(RankExecutor):
    """Runs `tensor_parallel_size` ranks in spawned processes of this machine."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        # Rendezvous through a file in a private folder: no port to pick, nothing to collide with.
        self._tmpdir = tempfile.mkdtemp(prefix="vllm_spec_tp_")
        init_method = "file://" + os.path.join(self._tmpdir, "rendezvous")
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        # Replies each rank owes: a call the driver stopped waiting for (an interrupt, e.g. Ctrl-C in
        # generate) is still answered, first; its reply is then read and dropped, not taken for the next.
        self._owed = [0] * self.world_size
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=run_rank_process, name=f"vllm-spec-tp{rank}",
                                   args=(config, rank, self.world_size, init_method, child), daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._tmpdir)
            budgets = self._call_all("init_worker", (init_method,), self._start_timeout)
            self.num_blocks = kv_blocks_for_ranks(config, budgets)
            self._call_all("init_kv_cache", (self.num_blocks,), self._start_timeout)
        except BaseException:
            _stop(self.procs, self.conns, self._tmpdir)
            raise

    # Calls ----------------------------------------------------------------------------------
    def _send(self, method: str, args: tuple) -> None:
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        rank = 0
        try:
            for rank, conn in enumerate(self.conns):
                if method != "shutdown" and (method != "execute_model" or rank == 0):   # (others: errors only)
                    self._owed[rank] += 1
                conn.send_bytes(payload)
        except OSError:   # its end of the pipe closed: the rank died (the same report as in _collect)
            raise self._fail(self._death_message(rank, method)) from None
        except BaseException:
            # Interrupted mid-send: a rank may hold part of a call, or a call the others lack.
            self._fail(f"sending {method} to the tensor-parallel workers was interrupted; the ranks can no "
                       "longer agree on what to run.")
            raise

    def _call_all(self, method: str, args: tuple, timeout: float | None, fatal_timeout: bool = True) -> list:
        """Every rank runs method(*args); their results, by rank."""
        self._check()
        self._send(method, args)
        return self._collect(set(range(self.world_size)), method, timeout, fatal_timeout)

    def _collect(self, waiting: set[int], method: str, timeout: float | None, fatal_timeout: bool = True) -> list:
        """The ranks' replies. Past the timeout: a WorkerError that stops the ranks, or (not fatal_timeout) a
        TimeoutError, the late replies then read and dropped before the next call's (see _owed)."""
        results: list = [None] * self.world_size
        deadline = None if timeout is None else time.monotonic() + timeout
        by_conn = {c: r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while waiting:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                message = f"tensor-parallel workers {sorted(waiting)} did not finish {method} within {timeout:g} s."
                if not fatal_timeout:
                    raise TimeoutError(message)
                raise self._fail(message)
            # Every rank's pipe (errors come from any rank) and every process's sentinel (death).
            ready = wait(list(self.conns) + list(by_sentinel), timeout=left)
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        status, value = obj.recv()
                        self._owed[rank] -= 1
                    except (EOFError, OSError):
                        raise self._fail(self._death_message(rank, method)) from None
                    except BaseException:   # a reply read in part, or read and not counted
                        self._fail(f"reading {method}'s reply from tensor-parallel worker rank {rank} was "
                                   "interrupted; the engine cannot continue.")
                        raise
                    if status == "error":
                        raise self._fail(self._error_message(rank, method, value))
                    if self._owed[rank] == 0:   # else the answer to a call nobody waits for any more
                        results[rank] = value
                        waiting.discard(rank)
            for obj in ready:
                if obj in by_sentinel:
                    rank = by_sentinel[obj]
                    if self.conns[rank].poll():
                        continue        # its last words (an error report) are read on the next round
                    raise self._fail(self._death_message(rank, method))
        return results

    def _error_message(self, rank: int, method: str, error: str) -> str:
        """A rank's error, led by the death of another rank when that is what broke its collective."""
        others = {p.sentinel: r for r, p in enumerate(self.procs) if r != rank}
        # Dead without a report of their own (a rank that failed too has its own error waiting).
        dead = [others[s] for s in (wait(list(others), timeout=1.0) if others else [])
                if not self.conns[others[s]].poll()]
        if dead:
            return f"{self._death_message(dead[0], method)} (rank {rank} then failed: {error.splitlines()[0]})"
        return f"tensor-parallel worker rank {rank} failed in {method}: {error}"

    def _death_message(self, rank: int, method: str) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = ("still running, its pipe closed" if code is None
               else f"exit code {code}" if code >= 0 else f"killed by signal {-code}")
        hint = (" Ranks are spawned: a script that builds the engine must guard its top level with "
                "`if __name__ == '__main__':`." if method == "init_worker" else "")
        return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) died during {method} ({how}); "
                f"the engine cannot continue.{hint}")

    def _stop_workers(self) -> None:
        _stop(self.procs, self.conns, None, grace=0.0)   # the survivors wait in a collective: no use waiting

    # Executor interface ---------------------------------------------------------------------
    def _rpc(self, payload: bytes, timeout: float | None) -> list:
        return self._call_all("collective_rpc", (payload,), timeout, fatal_timeout=False)

    def execute_model(self, req: ExecuteModelRequest) -> StepOutput:
        self._check()
        self._send("execute_model", (req,))
        return self._collect({0}, "execute_model", self._step_timeout)[0]

    def check_health(self) -> None:
        self._check()
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise self._fail(self._death_message(rank, "idle"))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            try:
                self._send("shutdown", ())
            except WorkerError:
                pass
        self._finalizer()


def _stop(procs, conns, tmpdir: str | None, grace: float = 5.0) -> None:
    """Let the ranks exit (they leave when told or when their pipe closes), then make sure they have."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()) if proc.is_alive() else 0)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5.0)
    for conn in conns:
        conn.close()
    if tmpdir:
        shutil.rmtree(tmpdir, ignore_errors=True)
