"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: inside :func:`no_host_sync`,
every tensor operation that would make a CUDA device wait for the host (reading a value back,
data-dependent shapes) raises. Kernel launches under the Triton interpreter are let through:
the interpreter copies to numpy by design, a GPU launch does not; so are the numpy views the
numba CPU kernels take (``as_numpy``: CPU tensors only, a CUDA tensor never goes there), and the
numpy view of what a counted ``.cpu()`` returned (the host's copy: reading it reads no device; a
CUDA tensor's own ``.numpy()`` raises)."""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import torch
import triton.runtime.interpreter as interpreter


class HostSync(RuntimeError):
    pass


@contextlib.contextmanager
def flag_kernel_launches():
    """Yields a dict whose ``"active"`` is True while the Triton interpreter runs a kernel launch
    or a numba CPU kernel takes its numpy views, so that checks on the library's own torch
    operations can leave those out."""
    flag = {"active": False}

    def flagged(launch):
        def call(*args, **kwargs):
            outer, flag["active"] = flag["active"], True
            try:
                return launch(*args, **kwargs)
            finally:
                flag["active"] = outer
        return call

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(interpreter.GridExecutor, "__call__",
                                              flagged(interpreter.GridExecutor.__call__)))
        for module in [m for name, m in sys.modules.items() if name.startswith("stree.kernels.")]:
            if hasattr(module, "as_numpy"):
                stack.enter_context(mock.patch.object(module, "as_numpy", flagged(module.as_numpy)))
        yield flag


@contextlib.contextmanager
def count_kernel_launches():
    """Yields a dict whose ``"count"`` counts the Triton launches made meanwhile, compiled
    (JITFunction) or interpreted alike."""
    from triton.runtime.jit import JITFunction

    seen = {"count": 0}
    with contextlib.ExitStack() as stack:
        for cls in (JITFunction, interpreter.InterpretedFunction):
            def run(self, *args, _real=cls.run, **kwargs):
                seen["count"] += not kwargs.get("warmup", False)
                return _real(self, *args, **kwargs)
            stack.enter_context(mock.patch.object(cls, "run", run))
        yield seen


def _fail(name):
    raise HostSync(f"{name} reads a device value on the host")


@contextlib.contextmanager
def _watch_host_reads(on_read):
    """Call ``on_read(name)`` for every tensor operation meanwhile that would make a CUDA device
    wait for the host (the Triton interpreter's own copies left out)."""
    T = torch.Tensor
    with contextlib.ExitStack() as stack:
        launch = stack.enter_context(flag_kernel_launches())
        armed = lambda: not launch["active"]

        # the tensors a counted read brought to the host: reading those again (their numpy view) reads
        # no device (kept alive here so that no later tensor takes a recorded id)
        on_host: dict[int, torch.Tensor] = {}

        def guard(name, original):
            def call(*args, **kwargs):
                again = name == "Tensor.numpy" and args and id(args[0]) in on_host
                if armed() and not again:
                    on_read(name)
                out = original(*args, **kwargs)
                if name == "Tensor.cpu" and isinstance(out, torch.Tensor):
                    on_host[id(out)] = out
                return out
            return call

        def guard_bool_index(name, original):
            """Indexing with a bool mask has a data-dependent shape (a nonzero under the hood)."""
            def call(self, index, *rest):
                parts = index if isinstance(index, tuple) else (index,)
                if armed() and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                    on_read(f"{name} with a bool mask")
                return original(self, index, *rest)
            return call

        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu", "nonzero", "masked_select"):
            stack.enter_context(mock.patch.object(T, name, guard(f"Tensor.{name}", getattr(T, name))))
        for name in ("nonzero", "masked_select", "unique"):
            stack.enter_context(mock.patch.object(torch, name, guard(f"torch.{name}", getattr(torch, name))))
        for name in ("__getitem__", "__setitem__"):
            stack.enter_context(mock.patch.object(T, name, guard_bool_index(f"Tensor.{name}", getattr(T, name))))
        yield


@contextlib.contextmanager
def no_host_sync():
    """Raise :class:`HostSync` at the first host read of a device value."""
    with _watch_host_reads(_fail):
        yield


@contextlib.contextmanager
def count_host_syncs():
    """Yields the list of host reads made meanwhile (their names), for budgets of "one per step"."""
    reads: list[str] = []
    with _watch_host_reads(reads.append):
        yield reads
