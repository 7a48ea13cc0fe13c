"""Run a function on several CPU processes joined by gloo, as torchrun would launch them (tests
and the tensor-parallel benchmark)."""

from __future__ import annotations

import os
import sys
import tempfile

import torch


def run_ranks(fn, world: int, *args, threads: int = 1) -> list:
    """``fn(tp, *args)`` on ``world`` spawned processes (``tp``: their
    :class:`~stree.models.parallel.TensorParallel`), each with ``threads`` torch threads; returns
    every rank's result (picklable, rank order). An exception on a rank is raised here."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, out, threads, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]


def _rank(rank: int, world: int, out: str, threads: int, fn, args) -> None:
    import torch.distributed as dist

    from ..models.parallel import TensorParallel

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    # A file rendezvous: no port to pick, so none that another socket can take in between.
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "rendezvous"), rank=rank,
                            world_size=world)
    try:
        result = fn(TensorParallel(), *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()
    # Done and saved: exit without the interpreter's teardown, as the command's ranks do (and for the
    # same reason: stree.tools.cli.entry). A spawned process otherwise ends through sys.exit, and
    # tearing down gloo's native threads there aborted a rank now and then under the test suite's
    # load ("terminate called without an active exception"), failing a run whose work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
