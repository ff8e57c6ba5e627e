"""This process's place in a ``torchrun`` job: its rank, the world size, and how the ranks exchange small values
(a gloo group of its own, on the CPU whatever the model runs on)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import (
    ExtractionError,
    LmprobeError,
)
from .ranks import Gather


@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process job: rank, world size, and how the ranks exchange small values."""

    rank: int
    world: int
    all_gather: Gather | None  # one value per rank, by rank (a gloo group of its own); None for one process

    def agree(self, check: Callable[[], None]) -> None:
        """Run ``check`` on every rank; when it fails on any, every rank raises the first rank's error (one
        rank cannot stop alone: the others would wait for it)."""
        if self.world == 1:
            check()
            return
        try:
            check()
            mine = None
        except LmprobeError as exc:
            mine = str(exc)
        found = [m for m in self.all_gather(mine) if m is not None]
        if found:
            raise ExtractionError(found[0])


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process: torchrun's, else (0, 1)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def start_ranks() -> Ranks:
    """One process, or a rank of ``torchrun``: then the process group is joined (gloo, on the CPU, whatever the
    model runs on) with a timeout sized for long extractions (``LMPROBE_DIST_TIMEOUT`` seconds, default 14 days:
    a rank that finishes early waits for the others instead of being killed by the default ten minutes), and a
    second gloo group carries the small exchanges of reading and planning."""
    from datetime import timedelta

    rank, world = rank_and_world()
    if world == 1:
        return Ranks(0, 1, None)
    import torch.distributed as dist

    if not dist.is_initialized():
        timeout = float(os.environ.get("LMPROBE_DIST_TIMEOUT", 14 * 24 * 3600))
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")

    def all_gather(value: Any) -> list:
        out: list = [None] * world
        dist.all_gather_object(out, value, group=group)
        return out

    return Ranks(rank, world, all_gather)
