"""``x @ weight.T + bias`` for few rows on the CPU: a register-tiled product (``gemm.cpp``) on a
copy of the weight packed into column blocks, compiled for the machine it runs on.

Why: a tree pass multiplies each weight by a tree's rows (13 for the paper's tree at batch 1, 26
at batch 2), a plain step by one row per sequence. Reading the weight is what one row costs; a
few more rows should cost little more, as each weight element read serves every row. MKL's
products do not work so for these sizes: on the project's Intel Xeon (AVX-512) their cost grew
nearly in step with the rows past a few, where this kernel, streaming each block of the weight
once into a tile of up to 14 rows (6 with AVX2), stayed near one row's cost up to a tile's rows
(docs/kernels.md has the figures). Which product runs for each size is still measured on the
machine at hand (:mod:`stree.models.layers.linear`): this is one more candidate. The same tile
also multiplies a tree scan's state, laid out as a weight is, packed block by block as it is read
(:func:`state_term_unchecked`: :func:`stree.kernels.cpu.tree_jit.state_terms`).

It is built on first use with the system's C++ compiler (``$CXX``, else ``c++``; ``-O3
-march=native -fopenmp``), once per machine and source, and the library kept under the cache directory
(``$STREE_CACHE_DIR``, else ``$XDG_CACHE_HOME/stree``, else ``~/.cache/stree``), named by a digest
of the source, the compiler, the flags and the CPU, so a library built for another CPU or from
another source is never loaded (a new build leaves the newest ``KEEP_BUILDS`` others there). Where
it cannot be built (no compiler, neither AVX-512F nor AVX2+FMA, not Linux-like) :func:`available`
is False and the reason is :func:`unavailable_reason`:
the other products remain. It runs on ``torch.get_num_threads()`` OpenMP threads; with PyTorch's
pip wheels, which bring their own ``libgomp``, the library joins that runtime rather than loading a
second one (seen in the process's memory map on the project's machine).

Each output element sums its ``K`` products in order in float32 with fused multiply-adds, tested
against the float64 product (``tests/kernels/test_gemm.py``); the plain PyTorch path of the same
product is ``F.linear``, the first of the measured choices.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import struct
import subprocess
from pathlib import Path

import torch

from .._common import cache_dir

__all__ = ["available", "block", "compile_library", "find_compiler", "pack", "product", "product_unchecked", "state_term_unchecked",
           "takes_state", "unavailable_reason"]

SOURCE = Path(__file__).with_name("gemm.cpp")
# built into the same library: a Mamba2 model's whole decoding step, calling the product directly
# (:mod:`.mamba_step`)
SOURCES = (SOURCE, Path(__file__).with_name("mamba_step.cpp"))
# (no contraction: the step keeps the numba kernels' multiplies and adds apart; the product's fused
# multiply-adds are its intrinsics'. No trapping math: the same operations in the same order, but GCC may
# then turn a row loop's selects into vector blends; without it, with AVX2 alone, the SiLU and the float16
# rounding loops stayed scalar ("control flow in loop"): docs/kernels.md, "Row loops in vectors with AVX2")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC",
         "-std=c++17")
_P, _L = ctypes.c_void_p, ctypes.c_long
_ARGS = struct.Struct("=11q")  # stree_gemm_args's one argument
# a packed weight's dtype -> its element type in gemm.cpp (W_F32, W_F16, W_BF16)
WEIGHT_TYPES = {torch.float32: -1, torch.float16: 0, torch.bfloat16: 1}
_STATE_ARGS = struct.Struct("=12q")  # stree_state_term_args's


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (``-march=native`` builds for exactly these)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def _build() -> tuple[ctypes.CDLL | None, str]:
    """The library for this machine, loaded (built first where the cache has none), or None and
    why not."""
    return compile_library(FLAGS)


def find_compiler() -> str | None:
    """The C++ compiler the library is built with: ``$CXX``, else ``c++`` or ``g++`` on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


# Libraries built from other sources, compilers, flags or CPUs that the cache keeps beside a new one,
# the newest (another installation's, the tests' other variant): every edit of a development install's
# sources had left its library behind for good.
KEEP_BUILDS = 8


def _prune_builds(directory: Path, keep: Path) -> None:
    """Remove the libraries in ``directory`` other than ``keep`` beyond the newest ``KEEP_BUILDS`` (one
    that another process removes meanwhile, or that cannot be removed, ends the pruning: nothing fatal)."""
    try:
        others = sorted((p for p in directory.glob("gemm-*.so") if p != keep), key=lambda p: p.stat().st_mtime,
                        reverse=True)
        for old in others[KEEP_BUILDS:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass


def compile_library(flags: tuple[str, ...], sources: tuple[Path, ...] = SOURCES) -> tuple[ctypes.CDLL | None, str]:
    """The library built with ``flags`` (a later ``-march`` overrides ``-march=native``: the tests
    build the AVX2 variant so on an AVX-512 machine) from ``sources`` (the library's own, or another
    revision's, which ``benchmarks/library_ab.py`` pairs with them), loaded, or None and why not."""
    if platform.system() not in ("Linux", "FreeBSD"):
        return None, f"the tiled product is built on Linux only, not {platform.system()}"
    compiler = find_compiler()
    if not compiler:
        return None, "no C++ compiler ($CXX, c++ or g++) on the PATH"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C++ compiler {compiler!r} does not run: {e}"
    text, names = b"\0".join(path.read_bytes() for path in sources), " and ".join(path.name for path in sources)
    digest = hashlib.sha256(b"\0".join([text, compiler.encode(), version.encode(), " ".join(flags).encode(),
                                        _cpu_identity().encode()])).hexdigest()[:20]
    path = cache_dir() / "kernels" / f"gemm-{digest}.so"
    if not path.exists():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # (another process may build the same one)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([compiler, *flags, "-o", str(tmp), *map(str, sources)], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                said = [line for line in done.stderr.splitlines() if "error" in line] or [f"exit {done.returncode}"]
                return None, f"building {names} with {compiler} failed: {said[0].strip()}"
            os.replace(tmp, path)
            _prune_builds(path.parent, path)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building {names} with {compiler} failed: {e}"
        finally:
            tmp.unlink(missing_ok=True)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"loading {path} failed: {e}"
    lib.stree_gemm_args.argtypes = [ctypes.c_char_p]
    lib.stree_gemm_args.restype = None
    lib.stree_gemm_pack.argtypes = [_P, _L, _L, _P]
    lib.stree_gemm_pack.restype = None
    lib.stree_gemm_pack_half.argtypes = [_P, _L, _L, _P]
    lib.stree_gemm_pack_half.restype = None
    lib.stree_state_term_args.argtypes = [ctypes.c_char_p]
    lib.stree_state_term_args.restype = None
    lib.stree_round_half.argtypes = [_P, _L, _L]
    lib.stree_round_half.restype = None
    for name in ("stree_mamba_step", "stree_mamba_tree", "stree_mamba_tree_greedy", "stree_mamba_prefill",
                 "stree_mamba_draft"):
        getattr(lib, name).argtypes = [ctypes.c_char_p]
        getattr(lib, name).restype = ctypes.c_long
    return lib, ""


def available() -> bool:
    """Whether the tiled product can run here (built, or buildable, for this CPU)."""
    return _build()[0] is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" where it is True)."""
    return _build()[1]


def library() -> ctypes.CDLL:
    lib, why = _build()
    if lib is None:
        raise RuntimeError(why)
    return lib


def block() -> int:
    """The columns of one packed block (32 with AVX-512, 16 with AVX2)."""
    return library().stree_gemm_block()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32, float16 or bfloat16, CPU) packed for :func:`product` in its
    dtype: ``[ceil(N / block), K, block]``, the columns past N zero. A half weight packed so is half
    the bytes, which a product of few rows, streaming its weight from memory, reads in about half the
    time (each vector widened to float32 exactly as it is loaded: the same sums as its float32
    copy's)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in WEIGHT_TYPES \
            or weight.device.type != "cpu":
        raise TypeError(f"weight must be a 2-D float32, float16 or bfloat16 CPU tensor, got {_described(weight)}")
    lib, w = library(), weight.detach().contiguous()
    n, k = w.shape
    nb = lib.stree_gemm_block()
    out = torch.empty((n + nb - 1) // nb, k, nb, dtype=w.dtype)
    (lib.stree_gemm_pack if w.dtype == torch.float32 else lib.stree_gemm_pack_half)(w.data_ptr(), n, k, out.data_ptr())
    return out


def product(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight.T (+ bias)`` for the weight :func:`pack` made ``packed`` of, which had
    ``out_features`` rows: ``[M, out_features]`` (float32), written into ``out`` where given
    (contiguous). ``x``: float32 CPU, unit stride along K (rows may be a strided slice). The kernel
    reads and writes raw memory, so every shape, dtype and device is checked here first."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" \
            or x.stride(1) != 1:
        raise TypeError(f"x must be a 2-D float32 CPU tensor with unit column stride, got {_described(x)}")
    if not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"out_features must be an int >= 1, got {out_features!r}")
    m, k = x.shape
    nb = library().stree_gemm_block()
    if not isinstance(packed, torch.Tensor) or packed.shape != (-(-out_features // nb), k, nb) \
            or packed.dtype not in WEIGHT_TYPES or packed.device.type != "cpu" or not packed.is_contiguous():
        raise ValueError(f"packed must be a packed [{out_features}, {k}] weight (contiguous float32 or half "
                         f"[{-(-out_features // nb)}, {k}, {nb}] on the CPU), got {_described(packed)}")
    for name, t, shape in (("bias", bias, (out_features,)), ("out", out, (m, out_features))):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != torch.float32
                              or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor of shape {list(shape)}, "
                             f"got {_described(t)}")
    return product_unchecked(x, packed, out_features, bias, out)


def product_unchecked(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`product` for a caller that made the arguments right (a decoding step multiplies
    nine weights, and the checks would cost a few percent of it). ``x`` may also be a contiguous
    ``[..., K]`` of more dims (a tree pass's ``[b, n, K]``), its rows multiplied as they lie, into
    ``out`` ``[..., N]``: the reshapes to and from two dims cost a tree pass's small products a
    tenth or more."""
    if x.dim() == 2:
        m, ldx = x.shape[0], x.stride(0)
        if out is None:
            out = torch.empty(m, out_features)
    else:
        shape = x.shape
        m, ldx = x.numel() // shape[-1], shape[-1]
        if out is None:  # (a tree pass's [b, n, K] as three ints: a tuple of its dims took twice as long)
            out = torch.empty(shape[0], shape[1], out_features) if len(shape) == 3 else \
                torch.empty((*shape[:-1], out_features))
    if m:
        library().stree_gemm_args(_ARGS.pack(x.data_ptr(), m, x.shape[-1], ldx, packed.data_ptr(), out_features,
                                          out.data_ptr(), out_features, 0 if bias is None else bias.data_ptr(),
                                          torch.get_num_threads(), WEIGHT_TYPES[packed.dtype]))
    return out


def takes_state(d_state: int) -> bool:
    """Whether :func:`state_term_unchecked` runs here for a state of ``d_state`` columns (built, and
    d_state within the kernel's scratch)."""
    return _state_kmax() >= d_state


@functools.lru_cache(maxsize=1)
def _state_kmax() -> int:
    lib = _build()[0]
    return lib.stree_state_kmax() if lib is not None else 0


def state_term_unchecked(c: int, batch: int, nodes: int, groups: int, d_state: int, node_stride: int,
                         row_stride: int, x0: int, heads: int, headdim: int, out: int) -> None:
    """A tree scan's state term before its decay, ``out[b, i, h, p] = C[b, i, g, :] . x0[b, h, p, :]``
    for head h of group g (``heads / groups`` heads a group), by the tiled product with each block of
    the state packed as it is read (``stree_state_term`` in gemm.cpp). Addresses of float32 memory:
    ``c`` the first node's C (its nodes ``node_stride`` floats apart, its rows ``row_stride``, group
    g at ``g * d_state``), ``x0`` a contiguous ``[batch, heads, headdim, d_state]`` state, ``out`` a
    contiguous ``[batch, nodes, heads, headdim]``; the caller vouches for them (a tree pass's scan
    calls this per layer, and the checks would cost what the product saves), and for
    :func:`takes_state`. Each output sums its d_state products in order with fused multiply-adds."""
    library().stree_state_term_args(_STATE_ARGS.pack(c, batch, nodes, groups, d_state, node_stride, row_stride, x0,
                                                  heads, headdim, out, torch.get_num_threads()))


def _described(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {t.device.type} tensor of shape {tuple(t.shape)} and strides {t.stride()}"
