"""Run a function on several CPU processes joined by gloo, as torchrun would launch them (tests
and the tensor-parallel benchmark)."""

from __future__ import annotations

import os
import socket
import tempfile

import torch


def run_ranks(fn, world: int, *args, threads: int = 1) -> list:
    """``fn(tp, *args)`` on ``world`` spawned processes (``tp``: their
    :class:`~stree.models.parallel.TensorParallel`), each with ``threads`` torch threads; returns
    every rank's result (picklable, rank order). An exception on a rank is raised here."""
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, port, out, threads, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]


def _rank(rank: int, world: int, port: int, out: str, threads: int, fn, args) -> None:
    import torch.distributed as dist

    from ..models.parallel import TensorParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(TensorParallel(), *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
