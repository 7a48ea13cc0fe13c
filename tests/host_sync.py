"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: inside :func:`no_host_sync`,
every tensor operation that would make a CUDA device wait for the host (reading a value back,
data-dependent shapes) raises. Kernel launches under the Triton interpreter are let through:
the interpreter copies to numpy by design, a GPU launch does not."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import triton.runtime.interpreter as interpreter


class HostSync(RuntimeError):
    pass


_state = {"armed": False}


def _banned(name):
    def fail(*args, **kwargs):
        raise HostSync(f"{name} reads a device value on the host")
    return fail


def _guard(name, original):
    def call(*args, **kwargs):
        if _state["armed"]:
            _banned(name)()
        return original(*args, **kwargs)
    return call


def _guard_bool_index(name, original):
    """Indexing with a bool mask has a data-dependent shape (a nonzero under the hood)."""
    def call(self, index, *rest):
        parts = index if isinstance(index, tuple) else (index,)
        if _state["armed"] and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            _banned(f"{name} with a bool mask")()
        return original(self, index, *rest)
    return call


def _unarmed(original):
    def call(*args, **kwargs):
        armed, _state["armed"] = _state["armed"], False
        try:
            return original(*args, **kwargs)
        finally:
            _state["armed"] = armed
    return call


@contextlib.contextmanager
def no_host_sync():
    T = torch.Tensor
    methods = ["item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu", "nonzero", "masked_select"]
    with contextlib.ExitStack() as stack:
        for name in methods:
            stack.enter_context(mock.patch.object(T, name, _guard(f"Tensor.{name}", getattr(T, name))))
        for name in ("nonzero", "masked_select", "unique"):
            stack.enter_context(mock.patch.object(torch, name, _guard(f"torch.{name}", getattr(torch, name))))
        for name in ("__getitem__", "__setitem__"):
            stack.enter_context(mock.patch.object(T, name, _guard_bool_index(f"Tensor.{name}", getattr(T, name))))
        stack.enter_context(mock.patch.object(interpreter.GridExecutor, "__call__",
                                              _unarmed(interpreter.GridExecutor.__call__)))
        _state["armed"] = True
        try:
            yield
        finally:
            _state["armed"] = False
