"""Argument checking, backend choice, and the dt / group conventions shared by the kernels."""

from __future__ import annotations

import functools
import math
import os
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..tree import PackedTrees, TreeIndex, host_array, tree_index

BACKENDS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INF = math.inf

# triton.jit picks the interpreter when it decorates a kernel, so what matters is the setting at
# the time this package was imported, not the environment now. (triton < 3.4 has no knobs.)
_knobs = getattr(triton, "knobs", None)
TRITON_INTERPRETED = (bool(_knobs.runtime.interpret) if _knobs is not None
                      else os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))
# Set by stree.kernels.aot.capture: launches are recorded, not run, so any device will do.
CAPTURING = False


def cache_dir() -> Path:
    """Where stree keeps what it measures and builds (the cost profiles, the tiled product's
    library): ``$STREE_CACHE_DIR``, else ``$XDG_CACHE_HOME/stree``, else ``~/.cache/stree``."""
    root = os.environ.get("STREE_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stree"
    return Path(root)


def jit_fits(*tensors) -> bool:
    """CPU float tensors (None allowed): what the numba-compiled CPU paths take under "auto", half
    ones read through float32 copies (:func:`readable`)."""
    return all(t is None or (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in FLOAT_DTYPES) for t in tensors)


def jit_takes(*tensors) -> bool:
    """Whether a numba path may run on ``tensors`` (None allowed): :func:`jit_fits`, no gradient
    wanted of any, and no graph being compiled (Inductor fuses the PyTorch path)."""
    if not jit_fits(*tensors) or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


# id(parameter) -> ((address, shape, strides), its numpy view); the entry goes with the parameter
_VIEWS: dict[int, tuple] = {}
# id(half parameter) -> ((version, address, shape, strides), its float32 copy as numpy); likewise
_WIDE: dict[int, tuple] = {}


def version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place change), -1 for an inference tensor (one
    made under ``torch.inference_mode``, as a model loaded inside it has for parameters), which
    keeps none: such a tensor cannot be changed outside inference mode, and a copy made of it is
    kept while its memory stays the same."""
    return -1 if t.is_inference() else t._version


def kept(store: dict, tensor: torch.Tensor, key: tuple, make):
    """``make(tensor.detach())``, kept in ``store`` (by the tensor's id) while ``key`` (what the
    result depends on: the tensor's memory, layout, version) stays the same; the entry goes with
    the tensor."""
    hit = store.get(id(tensor))
    if hit is None or hit[0] != key:
        if hit is None:
            weakref.finalize(tensor, store.pop, id(tensor), None)
        hit = store[id(tensor)] = (key, make(tensor.detach()))
    return hit[1]


def as_numpy(t: torch.Tensor):
    """The tensor's memory as a numpy array, for the numba kernels (a plain tensor costs no op). A
    tensor that requires grad (a parameter) is detached first, and its view kept while its memory
    and layout stay the same (a decoding pass hands every layer's parameters to the kernels, and
    detaching is a dispatcher call each time). In-place changes reach the view, as it is the same
    memory; a parameter given other storage or another shape gets a new view."""
    if not t.requires_grad:
        return host_array(t)  # (the array a host tensor was made from, without a dispatcher call)
    return kept(_VIEWS, t, (t.data_ptr(), t.shape, t.stride()), torch.Tensor.numpy)


def readable(t: torch.Tensor):
    """``t`` as the float32 array a numba kernel reads: its memory (:func:`as_numpy`) or, for a
    float16 or bfloat16 tensor, a float32 copy. numba has neither half type, and the kernels
    compute in float32 as the PyTorch paths do, so only the reading widens (exactly) and the
    caller rounds the outputs back once. A half parameter's copy is kept until the parameter
    changes (its version counter, memory or layout): a decoding pass hands every layer's to the
    kernels. What a kernel writes is never a copy: the callers give it float32 tensors."""
    if t.dtype == torch.float32:
        return as_numpy(t)
    if not t.requires_grad:
        return t.float().numpy()
    return kept(_WIDE, t, (version(t), t.data_ptr(), t.shape, t.stride()), lambda d: d.float().numpy())


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not (TRITON_INTERPRETED or CAPTURING):
        raise ValueError(
            f"backend='triton' got tensors on {device}: Triton kernels need CUDA tensors, or "
            "TRITON_INTERPRET=1 set before stree.kernels is imported"
        )
    return backend


def check_tensor(name, t, shape, device, *, kind="float", dtype=None):
    """Raise TypeError/ValueError naming ``name`` unless ``t`` is a tensor of ``shape`` on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if kind == "float" and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if kind == "int" and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise TypeError(f"{name} must have an integer dtype, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}: all inputs must be on one device")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def check_layout(name, t, layout: str):
    """Type and rank check for a float tensor whose sizes define the others (x, B, xBC)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.dim() != len(layout.split(",")):
        raise ValueError(f"{name} must have shape [{layout}], got {tuple(t.shape)}")
    return t.shape


def check_dt_limit(dt_limit):
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"dt_limit must be a pair of floats (lo, hi), got {dt_limit!r}") from exc
    if not lo <= hi:
        raise ValueError(f"dt_limit must satisfy lo <= hi, got {dt_limit!r}")
    return lo, hi


def check_ssm_params(nheads, headdim, device, A, D, dt_bias):
    """Check the per-head parameters; returns D as ``[h, p]`` (per-head D broadcast) or None."""
    check_tensor("A", A, (nheads,), device)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, (nheads,), device)
    if D is None:
        return None
    if not isinstance(D, torch.Tensor) or D.dim() not in (1, 2):
        raise ValueError(f"D must have shape ({nheads},) or ({nheads}, {headdim}), got {getattr(D, 'shape', type(D))}")
    check_tensor("D", D, (nheads,) if D.dim() == 1 else (nheads, headdim), device)
    return D[:, None].expand(nheads, headdim) if D.dim() == 1 else D


def check_groups(nheads, ngroups):
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    return nheads // ngroups


def check_tree(parents, batch, n, device) -> TreeIndex:
    """A TreeIndex for ``parents`` (tensor, sequence or TreeIndex) matching ``batch`` rows of ``n`` nodes."""
    if isinstance(parents, (torch.Tensor, TreeIndex)):
        if parents.device != device:
            raise ValueError(f"parents is on {parents.device} but x is on {device}: all inputs must be on one device")
    else:
        parents = torch.as_tensor(parents, device=device)
    index = tree_index(parents)
    if index.n != n:
        raise ValueError(f"parents describes {index.n} nodes but the inputs have n = {n}")
    return index.for_batch(batch)


def check_packed(name: str, t: torch.Tensor, parents) -> int | None:
    """With :class:`PackedTrees` for ``parents``: check ``t`` holds their nodes, ``[1, total, ...]``,
    and return the number of trees (the rows of the states); otherwise None."""
    if not isinstance(parents, PackedTrees):
        return None
    if t.shape[0] != 1 or t.shape[1] != parents.total:
        raise ValueError(f"with packed trees {name} must have shape [1, total = {parents.total}, ...], "
                         f"got {tuple(t.shape)}")
    if parents.device != t.device:
        raise ValueError(f"parents is on {parents.device} but {name} is on {t.device}: all inputs must be on one device")
    return parents.batch


def packed_strides(t: torch.Tensor) -> tuple:
    """``t``'s strides for a kernel's packed-trees variant: a program of tree b moves to the tree's
    first node itself, so b must not move it too (the batch stride is 0)."""
    return (0, *t.stride()[1:])


PAD_SLOT_ID = -1  # a row whose slot id is negative is padding: its state is neither read nor written


def check_slots(state_indices, batch: int, slots: int, device, validate: bool = True) -> None:
    """``state_indices`` ``[batch]`` (ints on ``device``): every id a slot in [0, slots) or padding
    (negative), no slot twice (two rows writing one slot would race); the values (with
    ``validate``: one device sync)."""
    check_tensor("state_indices", state_indices, (batch,), device, kind="int")
    if not validate:
        return
    real = state_indices[state_indices >= 0]
    if bool((real >= slots).any()):
        row = int(torch.nonzero(state_indices >= slots)[0])
        raise ValueError(f"state_indices[{row}] = {int(state_indices[row])} is not a slot in [0, {slots}) or padding "
                         f"(< 0)")
    if real.numel() != torch.unique(real).numel():
        raise ValueError(f"state_indices names a slot twice: {state_indices.tolist()}")


def pool_rows(name: str, state, layout: str, state_indices, batch: int, device) -> int:
    """The rows ``state`` holds: ``batch``; with ``state_indices`` the slots of a pool of layout
    ``layout`` (its dimensions and the slot table checked)."""
    if state_indices is None:
        return batch
    if not isinstance(state, torch.Tensor) or state.dim() != len(layout.split(",")):
        raise ValueError(f"with state_indices, {name} must be a pool [{layout}], got {getattr(state, 'shape', state)}")
    check_slots(state_indices, batch, state.shape[0], device)
    return state.shape[0]


def slot_rows(pool: torch.Tensor, state_indices: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The rows' states from a pool of slots (along ``dim``): zeros for padding rows."""
    rows = pool.index_select(dim, state_indices.long().clamp(min=0))
    real = (state_indices >= 0).view(*([1] * dim), -1, *([1] * (pool.dim() - dim - 1)))
    return torch.where(real, rows, torch.zeros((), dtype=pool.dtype, device=pool.device))


def put_slot_rows(pool: torch.Tensor, state_indices: torch.Tensor, rows: torch.Tensor, dim: int = 0) -> None:
    """Write the real rows' states (``rows``, one per row of ``state_indices``) into their slots."""
    keep = torch.nonzero(state_indices >= 0).flatten()
    pool.index_copy_(dim, state_indices.long()[keep], rows.index_select(dim, keep))


@functools.lru_cache(maxsize=64)
def identity_slots(batch: int, device: torch.device) -> torch.Tensor:
    """Row b in slot b: the slot table a kernel reads where the caller has no pool, made once per
    batch size and device, on a call's first launch (CUDA graphs capture only after warm-up calls,
    stree.runtime.graphs, so a capture finds it made and never records its making)."""
    return torch.arange(batch, dtype=torch.int32, device=device)


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in float32 (itself where it already is; None stays None): the PyTorch paths' arithmetic."""
    return t if t is None or t.dtype == torch.float32 else t.float()


def process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt -> clamp(softplus(dt + bias)) in fp32, softplus linear above 20 as in mamba_ssm. The
    clamp is skipped when it cannot bite (softplus is >= 0, so (0, inf) after it is a no-op)."""
    dt = f32(dt)
    if dt_bias is not None:
        dt = dt + f32(dt_bias)
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    if dt_softplus and dt_limit[0] <= 0 and dt_limit[1] == INF:
        return dt
    return dt.clamp(dt_limit[0], dt_limit[1])


def heads_view(t, nheads):
    """``[..., g, s]`` group tensor -> ``[..., h, s]``: head h reads group h // (h / g)."""
    return t.repeat_interleave(nheads // t.shape[-2], dim=-2)


def pow2_block(n, minimum=16):
    return max(minimum, triton.next_power_of_2(n))


def dot_precision(dtype):
    """fp32 operands get full-precision dots (no silent TF32); 16-bit ones are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def process_dt_tl(dt, bias, DT_SOFTPLUS: tl.constexpr, dt_lo, dt_hi):
    dt = dt + bias
    if DT_SOFTPLUS:
        # max(x, 0) + log1p(exp(-|x|)), with log1p by Goldberg's (1 + u) - 1 correction: a plain
        # log(1 + exp(x)) loses all relative precision for the small dt Mamba2 runs at.
        u = tl.exp(-tl.abs(dt))
        w = 1.0 + u
        log1p_u = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
        dt = tl.where(dt <= 20.0, tl.maximum(dt, 0.0) + log1p_u, dt)
    return tl.minimum(tl.maximum(dt, dt_lo), dt_hi)


@triton.jit
def tree_span(cu_ptr, b, n, VARLEN: tl.constexpr):
    """Row b's first node and node count: packed tree b's from the offsets (``VARLEN``: the batch
    strides are then 0, the program moves to the tree's first node), else 0 and the padded n."""
    if VARLEN:
        start = tl.load(cu_ptr + b)
        return start, tl.load(cu_ptr + b + 1) - start
    else:
        return 0, n
