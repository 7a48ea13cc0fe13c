"""Compile the library's Triton launches for real GPUs on a machine without one.

The interpreter (``TRITON_INTERPRET=1``) accepts kernels a GPU compiler rejects (``tl.dot`` with
K < 16) and says nothing about registers or spills. Triton compiles ahead of time on any machine:
:func:`capture` records every launch a call makes instead of running it (the kernel, and the
signature, constexprs and alignment attributes Triton would specialise a real launch on), and
:func:`compile_launch` builds PTX and a cubin for a target through Triton's own pipeline, then
asks that target's ``ptxas -v`` for registers, stack, spills and barriers.

Needs the kernels decorated for the compiler, i.e. a process where ``TRITON_INTERPRET`` was not
set when :mod:`stree.kernels` was imported (``python -m stree.tools.aotcheck`` is one).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, KernelInterface, create_function_from_signature

from . import _common

__all__ = ["TARGETS", "SHARED_LIMIT", "Launch", "CompileReport", "capture", "compile_launch", "jit_kernels"]

TARGETS = {"sm80": 80, "sm90": 90}
# Largest dynamic shared memory one block may use (A100: 163 KB, H100: 227 KB).
SHARED_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}


@dataclass(frozen=True)
class Spec:
    """What Triton compiles a launch into for one target (the key of its kernel cache)."""

    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def key(self) -> str:
        return repr((sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted((k, repr(v)) for k, v in self.options.items())))


@dataclass
class Launch:
    """One captured launch: ``kernel[grid](*args, **kwargs)`` reduced to what compiling it needs."""

    kernel: JITFunction
    grid: tuple
    scalars: dict  # runtime int / float arguments that are not strides (sizes, lengths)
    constants: dict  # constexpr arguments by name
    specs: dict  # target name -> Spec

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def describe(self) -> str:
        sizes = " ".join(f"{k}={v}" for k, v in {**self.scalars, **self.constants}.items())
        return f"grid={tuple(self.grid)} {sizes}"


def _bind(kernel: JITFunction, target: str, args, kwargs) -> Spec:
    """Triton's own specialisation of these arguments for ``target`` (as ``JITFunction.run`` does)."""
    backend = make_backend(GPUTarget("cuda", TARGETS[target], 32))
    kwargs = dict(kwargs)
    kwargs.setdefault("debug", kernel.debug or False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return Spec(dict(signature), dict(constexprs), dict(attrs), dict(options.__dict__))


def _record(kernel: JITFunction, grid, args, kwargs) -> Launch:
    names = [p.name for p in kernel.params]
    values = dict(zip(names, args))
    values.update(kwargs)
    constants = {p.name: values[p.name] for p in kernel.params if p.is_constexpr and p.name in values}
    scalars = {k: v for k, v in values.items()
               if k not in constants and isinstance(v, (int, float)) and not k.startswith("s_")}
    if callable(grid):
        grid = grid(values)
    specs = {t: _bind(kernel, t, args, kwargs) for t in TARGETS}
    return Launch(kernel, tuple(grid), scalars, constants, specs)


@contextlib.contextmanager
def capture():
    """Record the Triton launches made inside the block instead of running them.

    Yields the list the :class:`Launch` records are appended to. The kernels' outputs stay as
    allocated (``torch.empty``), so only shapes, dtypes and control flow mean anything inside.
    ``backend="triton"`` is accepted on CPU tensors meanwhile (nothing launches)."""
    if _common.TRITON_INTERPRETED:
        raise RuntimeError("stree.kernels was imported with TRITON_INTERPRET=1, so its kernels are "
                           "interpreter objects; capture needs a process without it (python -m stree.tools.aotcheck)")
    launches: list[Launch] = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(_record(self, grid, args, kwargs))

    JITFunction.run = run
    _common.CAPTURING = True
    try:
        yield launches
    finally:
        JITFunction.run = real_run
        _common.CAPTURING = False


@dataclass
class CompileReport:
    """One launch compiled for one target. Sizes in bytes; ``error`` is Triton's message (its
    location and last line) when the compile failed, and the other numbers are then 0."""

    kernel: str
    target: str
    launch: str
    num_warps: int = 0
    num_stages: int = 0
    shared: int = 0
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    barriers: int = 0
    cubin: int = 0
    seconds: float = 0.0
    error: str | None = None
    problems: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _error_line(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    where = next((ln for ln in lines if re.match(r"at \d+:\d+:?$", ln)), None)
    last = lines[-1] if lines else type(exc).__name__
    return f"{where.rstrip(':')}: {last}" if where else last


PTXAS_PATTERNS = {
    "stack": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "registers": r"Used (\d+) registers",
    "barriers": r"used (\d+) barriers",
}


def ptxas_report(ptx: str, capability: int) -> dict:
    """``ptxas -v`` of ``ptx`` with the binary and flags Triton itself uses for this target."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o", os.path.join(tmp, "k.o")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    found = {k: re.search(p, log) for k, p in PTXAS_PATTERNS.items()}
    missing = [k for k in ("registers", "stack") if found[k] is None]
    if missing:
        raise RuntimeError(f"ptxas -v printed no {missing} line:\n{log}")
    return {k: int(m.group(1)) if m else 0 for k, m in found.items()}


def compile_launch(launch: Launch, target: str) -> CompileReport:
    """PTX and cubin of ``launch`` for ``target`` ("sm80" / "sm90") and its resource report;
    ``problems`` lists what would fail or slow down on that GPU (error, spills, shared memory)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
    spec = launch.specs[target]
    report = CompileReport(launch.name, target, launch.describe())
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(launch.kernel, spec.signature, spec.constexprs, spec.attrs),
                                  target=GPUTarget("cuda", TARGETS[target], 32), options=spec.options)
        usage = ptxas_report(compiled.asm["ptx"], TARGETS[target])
    except Exception as exc:  # noqa: BLE001 - any compiler failure is the finding being reported
        report.error = _error_line(exc)
        report.problems.append(f"does not compile: {report.error}")
        return report
    report.seconds = time.perf_counter() - start
    meta = compiled.metadata
    report.num_warps, report.num_stages, report.shared = meta.num_warps, meta.num_stages, meta.shared
    report.cubin = len(compiled.asm["cubin"])
    for k, v in usage.items():
        setattr(report, k, v)
    if report.spill_stores or report.spill_loads:
        report.problems.append(f"spills ({report.spill_stores} B stores, {report.spill_loads} B loads, "
                               f"{report.registers} registers)")
    if report.shared > SHARED_LIMIT[target]:
        report.problems.append(f"needs {report.shared} B of shared memory, over {target}'s {SHARED_LIMIT[target]} B")
    return report


def jit_kernels() -> dict[str, KernelInterface]:
    """Every ``@triton.jit`` kernel (not helper) defined in :mod:`stree.kernels`, by name: what a
    complete capture must have launched. Helpers are the jit functions no launch reaches directly;
    by convention kernels end in ``_kernel``. (Compiled or interpreted, whichever this process has.)"""
    import importlib
    import pkgutil

    from .. import kernels

    found = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, KernelInterface) and name.endswith("_kernel") and obj.fn.__module__ == module.__name__:
                found[name] = obj
    return found
