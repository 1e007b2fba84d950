"""Process groups: the target's tensor-parallel group and the draft's sub-group.

With one process both groups are trivial and every collective is a no-op, so the
model code is written once for any tensor-parallel size.

With `tp` processes (one per rank, see executor/), `init_distributed` joins a
torch.distributed world (NCCL on GPUs, gloo on CPU): the target's group is the
whole world, and the draft's group is the sub-group of ranks [0, draft_tp) of the
same processes. Ranks outside the sub-group have no draft group (None): they skip
the draft and receive its proposals by broadcast from rank 0, which is rank 0 of
both groups.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """A tensor-parallel group as seen from one rank."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    # Global ranks of the group's members, by group rank (collectives address sources globally).
    ranks: list[int] = field(default_factory=lambda: [0])

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: every rank's `x` (same shape and dtype everywhere) becomes group rank src's."""
        if self.world_size > 1:
            assert x.is_contiguous()
            dist.broadcast(x, src=self.ranks[src], group=self.group)
        return x


_TP = GroupCoordinator()
_SAME_AS_TARGET = object()
_DRAFT_TP: GroupCoordinator | None | object = _SAME_AS_TARGET


def get_tp_group() -> GroupCoordinator:
    return _TP


def set_tp_group(group: GroupCoordinator) -> None:
    global _TP
    _TP = group


def get_draft_tp_group() -> GroupCoordinator | None:
    """The draft's group on this rank (the target's unless set); None on ranks outside the draft's sub-group."""
    return _TP if _DRAFT_TP is _SAME_AS_TARGET else _DRAFT_TP


def set_draft_tp_group(group: GroupCoordinator | None) -> None:
    global _DRAFT_TP
    _DRAFT_TP = group


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(world_size: int, rank: int, init_method: str, device: torch.device,
                     draft_tp_size: int = 1) -> tuple[GroupCoordinator, GroupCoordinator | None]:
    """Join the world of `world_size` ranks and build the target's group and the draft's sub-group.

    Every rank must call this (group creation is collective). Sets the module's groups and
    returns (target group, draft group or None when this rank is outside the draft's sub-group).
    `VLLM_SPEC_DIST_TIMEOUT_S` bounds how long a collective waits for a peer (default 600 s).
    """
    if not 1 <= draft_tp_size <= world_size or world_size % draft_tp_size:
        raise ValueError(f"draft tensor-parallel size {draft_tp_size} must divide tensor_parallel_size {world_size}.")
    timeout = datetime.timedelta(seconds=float(os.environ.get("VLLM_SPEC_DIST_TIMEOUT_S", "600")))
    dist.init_process_group(backend=dist_backend(device), init_method=init_method, world_size=world_size,
                            rank=rank, timeout=timeout)
    everyone = list(range(world_size))
    tp = GroupCoordinator(rank, world_size, dist.group.WORLD, everyone)
    if draft_tp_size == world_size:
        draft: GroupCoordinator | None = tp
    elif draft_tp_size == 1:
        draft = GroupCoordinator() if rank == 0 else None
    else:
        members = list(range(draft_tp_size))
        sub = dist.new_group(members)          # collective: every rank calls it, members or not
        draft = GroupCoordinator(rank, draft_tp_size, sub, members) if rank < draft_tp_size else None
    set_tp_group(tp)
    set_draft_tp_group(draft)
    return tp, draft


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    global _DRAFT_TP
    set_tp_group(GroupCoordinator())
    _DRAFT_TP = _SAME_AS_TARGET
