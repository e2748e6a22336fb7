"""A process group between a trainer and the engine's ranks, beside the engine's own
tensor-parallel group: the trainer's rank 0 broadcasts new weights over it.

Both sides meet at ``tcp://master_address:master_port`` (the trainer's rank 0 hosts the store)
and build the group the way SGLang's RL clients do (a prefix store named after the group, then
torch's group constructor), so a trainer written for SGLang joins it unchanged.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

JOIN_TIMEOUT = timedelta(minutes=2)  # meeting the trainer (the step loop waits meanwhile)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one broadcast of new weights


def init_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: timedelta = JOIN_TIMEOUT,
) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) the group; blocks until all ``world_size`` ranks arrive, at
    most ``timeout`` (the API first waits, off the step loop, until the trainer's store listens)."""
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
        else "pg_options"
    )
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=COLLECTIVE_TIMEOUT,
        **{options: None},
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are global ranks here
    return group


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
