"""One tensor-parallel rank: joins the process groups, builds its worker, runs the steps it is sent.

Used by both distributed executors: MultiprocExecutor runs it in a spawned process per rank
(`run_rank_process`), RayExecutor as a Ray actor. Every rank runs every step on the same
ExecuteModelRequest; rank 0's StepOutput is the step's result (the others return None).

Sampling across ranks: the logits every rank samples from are the same (the LM head's
all-gather), and every rank holds the same seeded generators, so ranks compute the same
tokens; where a rank's choice steers what happens next, rank 0's choice is broadcast and
used everywhere (speculation lengths, draft tokens, the verified tokens; see
SpecDecodeWorker), so the ranks can never drift apart, and only rank 0's outputs leave.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

import torch

from vllm_spec.config import EngineConfig
from vllm_spec.distributed.parallel_state import destroy_distributed, init_distributed
from vllm_spec.executor.base import rank_rpc
from vllm_spec.executor.uniproc_executor import num_kv_blocks
from vllm_spec.worker.batch import ExecuteModelRequest, StepOutput


class RankWorker:
    """The worker (plain or speculative) of one rank, built once the process groups exist."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.worker = None

    def init_worker(self, init_method: str, local_device: int | None = None) -> tuple[int, int]:
        """Join the groups and load this rank's shards; returns (KV bytes available, KV bytes per block)."""
        config = self.config
        device = config.model.device
        if device.type == "cuda":
            torch.cuda.set_device(self.rank if local_device is None else local_device)
        elif "OMP_NUM_THREADS" not in os.environ:
            # Ranks share this machine's cores: one process each, not each all of them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
        draft_tp = config.speculative.draft_tensor_parallel_size if config.speculative else 1
        init_distributed(self.world_size, self.rank, init_method, device, draft_tp)
        from vllm_spec.spec_decode.spec_decode_worker import SpecDecodeWorker
        from vllm_spec.worker.worker import Worker
        self.worker = SpecDecodeWorker(config) if config.speculative else Worker(config)
        return self.worker.available_kv_bytes(), self.worker.kv_bytes_per_block()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute_model(self, req: ExecuteModelRequest) -> StepOutput | None:
        out = self.worker.execute_model(req)
        return out if self.rank == 0 else None

    def collective_rpc(self, payload: bytes) -> bytes:
        return rank_rpc(self.worker, payload)

    def ping(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self.worker = None
        destroy_distributed()


def kv_blocks_for_ranks(config: EngineConfig, budgets: list[tuple[int, int]]) -> int:
    """One block count for every rank (the block manager is shared): what the tightest rank can hold.
    Ranks differ when the draft runs on a sub-group: its ranks also hold the draft's KV shard."""
    return min(num_kv_blocks(config, avail, per_block, config.num_lookahead_slots) for avail, per_block in budgets)


# Multiprocessing: the loop of a rank's process ------------------------------------------------------

def run_rank_process(config: EngineConfig, rank: int, world_size: int, init_method: str, conn) -> None:
    """Serve calls from the driver over `conn` until told to stop or the driver goes away.

    A call is a pickled (method, args) sent as bytes (pickled once by the driver for every
    rank). Replies are ("ok", result) or ("error", text); for execute_model only rank 0
    replies on success (the others only report errors), so a step costs one reply.
    """
    worker = RankWorker(config, rank, world_size)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break                                   # the driver is gone: nobody to serve
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*args)
        except BaseException as e:  # noqa: BLE001 - reported to the driver, then this rank stops
            text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            try:
                conn.send(("error", text))
            except (OSError, BrokenPipeError):
                pass
            _exit(1)
        if method != "execute_model" or rank == 0:
            try:
                conn.send(("ok", result))
            except (OSError, BrokenPipeError):
                break
    try:
        worker.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    _exit(0)


def _exit(code: int) -> None:
    """Leave at once: the interpreter's teardown of torch takes seconds and there is nothing to save."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
