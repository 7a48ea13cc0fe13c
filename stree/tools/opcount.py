"""Counting the work of a call in operator dispatches: what a decode step costs on the CPU and
(one kernel launch each, views aside) on a GPU. Deterministic, so budgets on it can be tests.

``count_ops(fn)`` runs ``fn`` under ``torch.profiler`` and counts the top-level ``aten::`` and
``mkldnn::`` ops (those no other such op called: a linear layer's product on oneDNN's packed weight
is one ``mkldnn::`` op where PyTorch's own is one ``aten::linear``, and which of the two a layer
takes is measured per process, stree.models.layers.linear, so both count alike). ``compute``
leaves out the metadata-only ops (views, splits, transposes, empty allocations): they launch
nothing on a GPU. Triton launches are counted apart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, profile

__all__ = ["OpCount", "count_ops", "METADATA_OPS"]

# Ops that only make a new view of existing storage, or reserve memory without touching it.
METADATA_OPS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
    "aten::expand", "aten::expand_as", "aten::as_strided", "aten::split", "aten::split_with_sizes", "aten::narrow",
    "aten::transpose", "aten::permute", "aten::t", "aten::detach", "aten::alias", "aten::unflatten",
    "aten::view_as", "aten::unbind", "aten::chunk", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::_reshape_alias",
})
OP_PREFIXES = ("aten::", "mkldnn::")  # the operator namespaces counted
# Ops that are views when their input allows it, and copy otherwise (then a child op shows it).
MAYBE_VIEW_OPS = frozenset({"aten::reshape", "aten::flatten", "aten::contiguous", "aten::to", "aten::type_as"})


@dataclass
class OpCount:
    total: int = 0  # top-level aten ops
    compute: int = 0  # of which not metadata-only
    triton_launches: int = 0
    by_name: Counter = field(default_factory=Counter)

    def __str__(self) -> str:
        return f"{self.total} ops ({self.compute} compute, {self.triton_launches} Triton launches)"


def _is_compute(event) -> bool:
    if event.name in METADATA_OPS:
        return False
    if event.name in MAYBE_VIEW_OPS:
        return any(c.name not in METADATA_OPS and c.name not in MAYBE_VIEW_OPS for c in event.cpu_children)
    return True


def count_ops(fn, warmup: int = 1, setup=None) -> OpCount:
    """Ops dispatched by one call of ``fn()`` (after ``warmup`` calls, which settle caches); with
    ``setup``, each call is ``fn(*setup())`` and the setup is not counted."""
    from triton.runtime.jit import KernelInterface

    if setup is not None:
        call = fn
        fn = lambda: call(*args)  # noqa: E731 - bound to the args of the coming call
    for _ in range(warmup):
        if setup is not None:
            args = setup()
        fn()
    launches = {"n": 0}
    runs = {}
    for cls in {type(obj) for obj in _kernel_objects()} or {KernelInterface}:
        runs[cls] = cls.run

        def run(self, *args, _real=cls.run, **kwargs):
            launches["n"] += 1
            return _real(self, *args, **kwargs)
        cls.run = run
    try:
        if setup is not None:
            args = setup()
        launches["n"] = 0  # the setup's launches are not the call's
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        for cls, real in runs.items():
            cls.run = real
    top = [e for e in prof.events() if e.name.startswith(OP_PREFIXES)
           and not (e.cpu_parent is not None and e.cpu_parent.name.startswith(OP_PREFIXES))]
    # The Triton interpreter runs kernels through torch ops of its own; those are not the call's.
    out = OpCount(triton_launches=launches["n"])
    for e in top:
        if _inside_interpreter(e):
            continue
        out.total += 1
        out.compute += _is_compute(e)
        out.by_name[e.name] += 1
    return out


def _kernel_objects():
    from ..kernels.aot import jit_kernels

    return jit_kernels().values()


def _inside_interpreter(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if "GridExecutor" in parent.name or "interpreter" in parent.name:
            return True
        parent = parent.cpu_parent
    return False
