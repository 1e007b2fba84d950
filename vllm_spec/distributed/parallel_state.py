"""Process groups: the target's tensor-parallel group and the draft's sub-group.

With one process both groups are trivial and every collective is a no-op, so the
model code is written once for any tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """A tensor-parallel group as seen from one rank."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

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


_TP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def set_tp_group(group: GroupCoordinator) -> None:
    global _TP
    _TP = group
