"""Tensor parallelism over Ray: the same rank workers as MultiprocExecutor, as Ray actors (multi-node).

Connects to the Ray cluster of RAY_ADDRESS (or the one this process already joined), else starts a
local one. Each step's ExecuteModelRequest is put in the object store once and every actor runs
it; rank 0's StepOutput is the result. The ranks rendezvous over TCP at rank 0's node. A dead
actor (or a failing one) fails the step with WorkerError and every later step too.
"""

from __future__ import annotations

import os
import socket
import time
import weakref

from vllm_spec.config import EngineConfig
from vllm_spec.executor.base import RankExecutor
from vllm_spec.executor.rank_worker import RankWorker, kv_blocks_for_ranks
from vllm_spec.worker.batch import ExecuteModelRequest, StepOutput


class _RayRankWorker(RankWorker):
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for the ranks' TCP rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port


class RayExecutor(RankExecutor):
    """Runs `tensor_parallel_size` ranks as Ray actors (one GPU each on GPUs, one CPU each on CPU)."""

    def __init__(self, config: EngineConfig):
        try:
            import ray
        except ImportError as e:
            raise ImportError("distributed_executor_backend='ray' needs Ray: pip install ray") from e
        super().__init__(config)
        self.ray = ray
        tp = self.world_size
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)
        gpu = config.model.device.type == "cuda"
        if gpu and ray.cluster_resources().get("GPU", 0) < tp:
            raise ValueError(f"tensor_parallel_size ({tp}) is larger than the number of GPUs in the Ray cluster "
                             f"({int(ray.cluster_resources().get('GPU', 0))}).")
        # The actors import vllm_spec from where this process does (a source checkout included).
        import vllm_spec
        root = os.path.dirname(os.path.dirname(os.path.abspath(vllm_spec.__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        actor_cls = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, max_restarts=0)(_RayRankWorker)
        self.actors = [actor_cls.options(runtime_env={"env_vars": {"PYTHONPATH": path}}).remote(config, rank, tp)
                       for rank in range(tp)]
        self._finalizer = weakref.finalize(self, _kill, ray, list(self.actors))
        try:
            ip, port = self._get([self.actors[0].rendezvous_address.remote()], "start", self._start_timeout)[0]
            init_method = f"tcp://{ip}:{port}"
            budgets = self._get([a.init_worker.remote(init_method, 0 if gpu else None) for a in self.actors],
                                "init_worker", self._start_timeout)
            self.num_blocks = kv_blocks_for_ranks(config, budgets)
            self._get([a.init_kv_cache.remote(self.num_blocks) for a in self.actors], "init_kv_cache",
                      self._start_timeout)
        except BaseException:
            self._finalizer()
            raise

    def _get(self, refs: list, method: str, timeout: float | None, fatal_timeout: bool = True) -> list:
        """Results of one call per rank, by rank; a rank that dies or fails fails them all at once. Past the
        timeout: a WorkerError that stops the ranks, or (not fatal_timeout) a TimeoutError, the actors' queues
        running the call on."""
        ray = self.ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                message = (f"tensor-parallel workers {sorted(rank_of[r] for r in pending)} did not finish {method} "
                           f"within {timeout:g} s.")
                if not fatal_timeout:
                    raise TimeoutError(message)
                raise self._fail(message)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise self._fail(f"tensor-parallel worker rank {rank} (Ray actor) died during {method}: "
                                     f"{type(e).__name__}; the engine cannot continue.") from None
                except ray.exceptions.RayTaskError as e:
                    # When another rank died, that death is what broke this rank's collective: say so.
                    died = self._dead_rank(pending, rank_of)
                    lead = f"tensor-parallel worker rank {died} (Ray actor) died during {method}; " if died else ""
                    raise self._fail(f"{lead}tensor-parallel worker rank {rank} failed in {method}: {e}") from None
        return results

    def _dead_rank(self, pending: list, rank_of: dict) -> int | None:
        ready, _ = self.ray.wait(pending, num_returns=len(pending), timeout=1.0)
        for ref in ready:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                return rank_of[ref]
            except Exception:  # noqa: BLE001 - only deaths matter here
                pass
        return None

    def _stop_workers(self) -> None:
        self._finalizer()

    def _rpc(self, payload: bytes, timeout: float | None) -> list:
        return self._get([a.collective_rpc.remote(payload) for a in self.actors], "collective_rpc", timeout,
                         fatal_timeout=False)

    def execute_model(self, req: ExecuteModelRequest) -> StepOutput:
        self._check()
        ref = self.ray.put(req)                       # serialised once, read by every rank
        return self._get([a.execute_model.remote(ref) for a in self.actors], "execute_model",
                         self._step_timeout)[0]

    def check_health(self) -> None:
        self._check()
        self._get([a.ping.remote() for a in self.actors], "ping", 60.0)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()


def _kill(ray, actors) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, or Ray is shut down
            pass
