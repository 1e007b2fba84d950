"""What the multi-process and Ray executors share: start-up/step timeouts and failing for good; and the
collective_rpc calls every executor makes on its workers."""

from __future__ import annotations

import io
import logging
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from vllm_spec.config import EngineConfig
from vllm_spec.utils import is_number
from vllm_spec.worker.batch import ExecuteModelRequest, StepOutput
from vllm_spec.worker.step_handle import DoneStep, StepHandle

logger = logging.getLogger(__name__)


class _MainModuleFinder(pickle.Pickler):
    """Pickles to nowhere, noting an object whose class or function is defined in __main__."""

    def __init__(self):
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.found: object | None = None

    def reducer_override(self, obj):
        if self.found is None and getattr(obj, "__module__", None) == "__main__":
            self.found = obj
        return NotImplemented


def check_sendable_to_ranks(value: object, field: str) -> None:
    """ValueError naming `field` unless the ranks' processes can unpickle `value`: it must pickle, and
    hold nothing defined in a __main__ they cannot import (code run with -c, a REPL or a notebook: a
    spawned rank re-imports the main module from its file, when it has one). Checked per request: a
    step the ranks could not read would stop them all."""
    finder = _MainModuleFinder()
    try:
        finder.dump(value)
    except Exception as e:
        raise ValueError(f"{field} must be picklable with tensor_parallel_size > 1 (each step goes to the "
                         f"ranks' processes): {type(e).__name__}: {e}") from None
    main = sys.modules.get("__main__")
    if finder.found is not None and getattr(main, "__file__", None) is None:
        raise ValueError(f"{field} holds {finder.found!r}, defined in __main__, which the tensor-parallel ranks' "
                         "processes cannot import: define it in a module of its own.")


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the executor cannot run any more steps."""


# A collective_rpc timeout above this is none (the waits refuse inf and the like).
_MAX_RPC_TIMEOUT = 1e6


def rpc_call(method: Any, timeout: Any, args: Any, kwargs: Any) -> tuple[str | Callable, float | None, tuple, dict]:
    """collective_rpc's arguments checked (a ValueError naming the one that is wrong), in the executors' form."""
    if not (isinstance(method, str) or callable(method)):
        raise ValueError(f"collective_rpc: method must be a worker method's name or a callable taking the worker "
                         f"first, got {type(method).__name__}.")
    if timeout is not None and not (is_number(timeout) and timeout > 0):
        raise ValueError(f"collective_rpc: timeout must be a positive number of seconds or None, got {timeout!r}.")
    if timeout is not None and timeout > _MAX_RPC_TIMEOUT:
        timeout = None
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"collective_rpc: args must be a tuple or a list, got {type(args).__name__}.")
    if not (kwargs is None or isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise ValueError(f"collective_rpc: kwargs must be a dict of keyword names or None, got {kwargs!r}.")
    return method, timeout, tuple(args), dict(kwargs or {})


def rank_rpc(worker: Any, payload: bytes) -> bytes:
    """A rank's side of collective_rpc: the call's ("ok", result) or ("error", what it raised, with its
    traceback), as cloudpickle's bytes (the caller gets copies, never tensors shared with the rank; anything
    cloudpickle carries). A call that fails, or a result that cannot travel, must not stop the rank."""
    try:
        method, args, kwargs = cloudpickle.loads(payload)
        return cloudpickle.dumps(("ok", call_worker(worker, method, args, kwargs)))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit too: reported to the caller
        return cloudpickle.dumps(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def apply_to_model(func: Callable, worker: Any) -> Any:
    """apply_model's call on one worker (collective_rpc's callable: functools.partial(apply_to_model, func))."""
    return func(worker.get_model())


def call_worker(worker: Any, method: str | Callable, args: tuple, kwargs: dict) -> Any:
    """vLLM's collective_rpc on one worker: the worker's method of that name, or the callable given the worker
    first."""
    if isinstance(method, str):
        fn = getattr(worker, method, None)
        if method.startswith("_") or not callable(fn):
            raise ValueError(f"collective_rpc: the worker ({type(worker).__name__}) has no method {method!r}.")
        return fn(*args, **kwargs)
    return method(worker, *args, **kwargs)


def _timeout_from_env(name: str, default: float | None) -> float | None:
    value = os.environ.get(name)
    if value is None:
        return default
    return float(value) if float(value) > 0 else None


class RankExecutor:
    """Base of the executors that run one worker per tensor-parallel rank.

    Timeouts (seconds; env overrides, 0 = none): VLLM_SPEC_WORKER_START_TIMEOUT_S (loading
    and KV allocation, default 1200) and VLLM_SPEC_STEP_TIMEOUT_S (one step, default none: a
    dead rank is noticed at once without it). After the first failure every call fails.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.world_size = config.parallel.tensor_parallel_size
        self._error: WorkerError | None = None
        self._closed = False
        self._start_timeout = _timeout_from_env("VLLM_SPEC_WORKER_START_TIMEOUT_S", 1200.0)
        self._step_timeout = _timeout_from_env("VLLM_SPEC_STEP_TIMEOUT_S", None)

    def _stop_workers(self) -> None:
        raise NotImplementedError

    def execute_model(self, req: ExecuteModelRequest) -> StepOutput:
        raise NotImplementedError

    def launch(self, req: ExecuteModelRequest) -> StepHandle:
        """Ranks in other processes answer a step only once it has run: no overlap with the next one."""
        return DoneStep(self.execute_model(req))

    def collective_rpc(self, method: str | Callable, timeout: float | None, args: tuple, kwargs: dict) -> list:
        """Every rank's worker runs the call (call_worker); their results by rank. The call travels as
        cloudpickle's bytes (a lambda does), and what a rank raises is raised here, the ranks serving on."""
        try:
            payload = cloudpickle.dumps((method, args, kwargs))
        except Exception as e:
            raise ValueError(f"collective_rpc: the method and its arguments must pickle (cloudpickle) to reach the "
                             f"tensor-parallel ranks: {type(e).__name__}: {e}") from None
        self._check()
        replies = [cloudpickle.loads(reply) for reply in self._rpc(payload, timeout)]
        for rank, (status, value) in enumerate(replies):
            if status == "error":
                raise RuntimeError(f"collective_rpc failed on tensor-parallel rank {rank}: {value}")
        return [value for _, value in replies]

    def _rpc(self, payload: bytes, timeout: float | None) -> list:
        raise NotImplementedError

    def _fail(self, message: str) -> WorkerError:
        logger.error("%s Stopping all tensor-parallel workers.", message)
        self._error = WorkerError(message)
        self._stop_workers()
        return self._error

    def _check(self) -> None:
        if self._error is not None:
            raise WorkerError(f"the tensor-parallel workers are gone: {self._error}") from self._error
        if self._closed:
            raise WorkerError("the executor is shut down.")
