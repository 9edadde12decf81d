"""Ranks under torchrun, for the commands that run on several processes (predict, train, eval).

One process is the plain case: `init_distributed` returns rank 0 of 1 and nothing else here does any work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None) -> Distributed:
    """Join the process group torchrun describes in the environment (one process: nothing to do)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Distributed()
    import torch.distributed as dist  # noqa: PLC0415 - only under torchrun

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    return Distributed(dist.get_rank(), dist.get_world_size(), local_rank)


def gather_objects(items: list, dist_info: Distributed) -> list[list]:
    """Every rank's list, on every rank (one list per rank, in rank order)."""
    if dist_info.world == 1:
        return [items]
    import torch.distributed as dist  # noqa: PLC0415 - only under torchrun

    out: list[Any] = [None] * dist_info.world
    dist.all_gather_object(out, items)
    return out


@contextmanager
def process_group(dist_info: Distributed) -> Iterator[None]:
    """Under torchrun, destroy the process group when the body ends; when it ends well, every process
    first waits at a barrier for the others, so none tears its group down while a peer is still
    finishing (gloo then aborted the early one with SIGABRT, "terminate called without an active
    exception", seen once in the two-process training test). After an error there is no
    barrier: a peer that failed would never reach it."""
    finished = False
    try:
        yield
        finished = True
    finally:
        if dist_info.world > 1:
            import torch.distributed as dist  # noqa: PLC0415 - only under torchrun

            if finished:
                dist.barrier()
            dist.destroy_process_group()
