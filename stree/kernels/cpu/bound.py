"""A layer's numba kernels bound to its parameters, for a decoding pass on the CPU.

The public kernels (:func:`~stree.kernels.tree_conv1d`, :func:`~stree.kernels.tree_scan`,
:func:`~stree.kernels.gated_rms_norm`, :func:`~stree.kernels.conv_step`,
:func:`~stree.kernels.selective_state_update`, :func:`~stree.kernels.rms_norm`,
:func:`~stree.kernels.replay`) check every argument and read every parameter into numpy on each
call. A layer of a small model spends more on that than on the kernels' own work, and a Mamba2
block makes four such calls a pass. :class:`Mamba2LayerJit` and :class:`RMSNormJit` read the
parameters once (checked then) and call the same numba kernels directly on activations whose shapes
the layer's own products and cache vouch for, and :func:`replay_in_place` commits a model's
accepted paths likewise: the same results, bit for bit (tests/kernels/test_bound.py), without the
per-call checks.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .._common import FLOAT_DTYPES, as_numpy
from . import gemm
from .norm_jit import gated_rms_norm_rows, rms_norm_rows
from .replay_jit import replay_layers
from .round_jit import round_half
from .step_jit import conv_step_rows, state_update_rows
from .layer_jit import tree_layer_in, tree_layer_out
from .tree_jit import (NOT_MADE, aligned_empty, chain_scan_rows, parallel_rows, takes_tree, tiled_state,
                       tree_conv_rows, tree_scan_rows)

__all__ = ["Mamba2LayerJit", "RMSNormJit", "aligned_array", "replay_arrays", "replay_in_place"]


def _check_params(**tensors) -> None:
    for name, t in tensors.items():
        if t is not None and not (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype == torch.float32):
            raise TypeError(f"{name} must be a CPU float32 tensor, got {getattr(t, 'dtype', type(t))}")


def _read(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _round(a: np.ndarray, dtype: torch.dtype) -> None:
    """``a`` (float32, contiguous) rounded in place to ``dtype``'s values: where a public kernel
    returns a half output, which the next one reads widened again."""
    if dtype != torch.float32:
        round_half(a, dtype == torch.bfloat16)


def aligned_array(shape: tuple) -> np.ndarray:
    """A float32 array of ``shape`` starting on a 64-byte boundary (:func:`.tree_jit.aligned_empty`)."""
    return aligned_empty(math.prod(shape)).reshape(shape)


def _empty_pair(shape: tuple) -> tuple[torch.Tensor, np.ndarray]:
    """A float32 output of ``shape`` as a tensor and its memory as an array, on a 64-byte boundary as
    torch's own: made as an array and handed to torch (one dispatcher call), where a tensor made
    by torch and then read as an array took five (a ``.numpy()`` is four), microseconds each on
    a pass's host side."""
    a = aligned_array(shape)
    return torch.from_numpy(a), a


def _state(t: torch.Tensor, view: np.ndarray | None, of: torch.Tensor | None = None) -> np.ndarray:
    """A state tensor's memory as an array: ``view`` (the cache's, :attr:`SSMLayerState.arrays`)
    where given and ``t`` is the tensor it views (``of``, where ``t`` may be a float32 copy of it)."""
    return view if view is not None and (of is None or t is of) else as_numpy(t)


class RMSNormJit:
    """:func:`~stree.kernels.rms_norm` with ``weight [dim]`` (a CPU float32 tensor, read as it is
    now) and ``eps``, of CPU float32 activations ``[..., dim]``."""

    def __init__(self, weight: torch.Tensor, eps: float):
        _check_params(weight=weight)
        if weight.dim() != 1:
            raise ValueError(f"weight must have shape [dim], got {tuple(weight.shape)}")
        self.weight, self.eps = _read(weight), float(eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out, out_a = _empty_pair(x.shape)
        dim = x.shape[-1]
        rms_norm_rows(as_numpy(x).reshape(-1, dim), self.weight, True, self.eps, out_a.reshape(-1, dim))
        return out


class Mamba2LayerJit:
    """The conv (``conv_weight [dim, 1, K]`` or ``[dim, K]``, ``conv_bias [dim]`` or None), the scan
    (``A``, ``dt_bias [h]``, ``D [h]`` or ``[h, p]``; softplus; the clamp is each call's) and the
    gated RMSNorm (``norm_weight [h * p]`` in groups of ``group_size``, ``eps``, ``gate_first``) of
    one layer, every parameter a CPU float32 tensor, read as it is now: a layer whose parameters
    change makes a new one (the model keys it by their versions). ``x_dim`` and ``B_dim``: the
    widths of x and B in the conv's channels (C takes the rest; MambaInLlama's d_xb variant has x
    and B narrower, one head / group per KV head, repeated after the conv); ``d_state``.

    :meth:`step` and :meth:`tree` take the layer's in_proj output as it comes (``z``, ``xBC``,
    ``dt`` side by side) and split it into NumPy views, not torch ones: a layer's dozen views and
    buffers made as tensors cost a small model's step more than its conv and recurrence do.
    Activations are CPU tensors of ``dtype`` (float32, or float16 / bfloat16: a half model's, whose
    parameters the caller hands over widened), the SSM state float32, the conv state float32 or of
    ``dtype``, both contiguous; nothing about them is checked."""

    def __init__(self, conv_weight, conv_bias, A, D, dt_bias, norm_weight, group_size: int, eps: float,
                 gate_first: bool, *, x_dim: int, B_dim: int, d_state: int, dtype: torch.dtype = torch.float32):
        _check_params(conv_weight=conv_weight, conv_bias=conv_bias, A=A, D=D, dt_bias=dt_bias, norm_weight=norm_weight)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        dim, heads = conv_weight.shape[0], A.shape[0]
        if conv_bias is not None and tuple(conv_bias.shape) != (dim,):
            raise ValueError(f"conv_bias must have shape ({dim},), got {tuple(conv_bias.shape)}")
        if tuple(dt_bias.shape) != (heads,) or D.shape[0] != heads or norm_weight.numel() % heads:
            raise ValueError(f"dt_bias, D and the norm's channels must come in A's {heads} heads, got "
                             f"{tuple(dt_bias.shape)}, {tuple(D.shape)} and {tuple(norm_weight.shape)}")
        if norm_weight.numel() % group_size:
            raise ValueError(f"group_size ({group_size}) must divide the norm's {norm_weight.numel()} channels")
        headdim = norm_weight.numel() // heads
        C_dim = dim - x_dim - B_dim
        if (x_dim % headdim or heads % max(x_dim // headdim, 1) or B_dim % d_state or C_dim <= 0 or C_dim % d_state
                or (C_dim // d_state) % max(B_dim // d_state, 1)):
            raise ValueError(f"x_dim {x_dim}, B_dim {B_dim} and d_state {d_state} do not split the conv's {dim} "
                             f"channels into x (heads of {headdim}), B and C")
        self.conv_weight = _read(conv_weight.reshape(dim, -1))
        self.has_conv_bias = conv_bias is not None
        self.conv_bias = _read(conv_bias) if conv_bias is not None else self.conv_weight[:, 0]
        self.A, self.dt_bias = _read(A), _read(dt_bias)
        self.D = _read(D if D.dim() == 2 else D[:, None].expand(heads, headdim))  # (the kernels' [h, p])
        self.norm_weight = _read(norm_weight.reshape(-1, group_size))
        self.group_size, self.eps, self.gate_first = group_size, float(eps), bool(gate_first)
        self.d_inner, self.dim, self.heads, self.headdim = norm_weight.numel(), dim, heads, headdim
        self.x_dim, self.B_dim, self.d_state = x_dim, B_dim, d_state
        self.dtype = dtype
        # a tree pass's work per node (the scan's and the conv's elements: whether its rows run in
        # parallel) and how its outputs round (-1 float32, 0 float16, 1 bfloat16), made once
        self._node_work = (heads * headdim * d_state, dim * self.conv_weight.shape[1])
        self._rounding = -1 if dtype == torch.float32 else int(dtype == torch.bfloat16)

    @staticmethod
    def takes_tree(index) -> bool:
        """Whether :meth:`tree` takes the tree of ``index`` (a :class:`~stree.tree.TreeIndex`): the
        tree kernel's (:func:`.tree_jit.takes_tree`); a prompt's longer chain, or a deep tree, is
        the public kernels' work."""
        return takes_tree(index)

    def _split(self, proj: np.ndarray):
        """z, xBC and dt: views of the in_proj output ``[..., d_inner + dim + h]``."""
        a, b = self.d_inner, self.d_inner + self.dim
        return proj[..., :a], proj[..., a:b], proj[..., b:]

    def _ssm_inputs(self, conv: np.ndarray):
        """x ``[..., h, p]``, B and C ``[..., g, s]``: views of the conv's output (x and B repeated
        into copies in the d_xb variant, as the PyTorch path's ``repeat_interleave`` makes them)."""
        lead, s = conv.shape[:-1], self.d_state
        x_end, b_end = self.x_dim, self.x_dim + self.B_dim
        x = conv[..., :x_end].reshape(*lead, self.x_dim // self.headdim, self.headdim)
        B = conv[..., x_end:b_end].reshape(*lead, self.B_dim // s, s)
        C = conv[..., b_end:].reshape(*lead, (self.dim - b_end) // s, s)
        if x.shape[-2] != self.heads:
            x = np.repeat(x, self.heads // x.shape[-2], axis=-2)
        if B.shape[-2] != C.shape[-2]:
            B = np.repeat(B, C.shape[-2] // B.shape[-2], axis=-2)
        return x, B, C

    def _gated_norm(self, y: np.ndarray, proj: torch.Tensor) -> torch.Tensor:
        """The gated norm of y ``[..., h, p]`` (contiguous, the scan's) by z, the first ``d_inner``
        channels of ``proj`` (float32); returns ``[..., d_inner]`` of the activations' dtype. The
        gate's SiLU is one vectorised op."""
        width = self.group_size
        z = proj[..., : self.d_inner]
        out, out_a = _empty_pair(z.shape)
        gated_rms_norm_rows(y.reshape(-1, width), as_numpy(F.silu(z)).reshape(-1, width), self.norm_weight, True,
                            self.eps, self.gate_first, out_a.reshape(-1, width))
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def _wide(self, t: torch.Tensor) -> torch.Tensor:
        """An activation or a conv state in float32 (itself where it is)."""
        return t if t.dtype == torch.float32 else t.float()

    # -- a tree pass: every node's outputs, the states only read -------------------------------
    def scratch_tails(self) -> tuple[tuple[int, ...], ...]:
        """The trailing shapes of what :meth:`tree` keeps per node for replay (xBC, x, dt, B), x and
        B repeated as :meth:`_ssm_inputs` makes them."""
        c_groups = (self.dim - self.x_dim - self.B_dim) // self.d_state
        return (self.dim,), (self.heads, self.headdim), (self.heads,), (c_groups, self.d_state)

    def tree(self, proj: torch.Tensor, parents: torch.Tensor | np.ndarray, conv_state: torch.Tensor,
             ssm_state: torch.Tensor, dt_limit, into: tuple[np.ndarray, ...] | None = None,
             chain: bool = False, states: tuple = (None, None)) -> tuple[torch.Tensor, tuple | None]:
        """:func:`~stree.kernels.tree_conv1d` with SiLU, :func:`~stree.kernels.tree_scan` with D,
        dt_bias, softplus and ``dt_limit`` ``(lo, hi)``, and the gated norm, of proj ``[b, n, ...]``
        over parents ``[rows, n]`` (rows 1 or b; int64, a tensor or its array), conv_state ``[b, dim,
        K]`` and ssm_state ``[b, h, p, s]``: the norm's output ``[b, n, d_inner]`` and what replay reads, (xBC, x,
        dt, B) as tensors of the activations' dtype; or, given ``into`` (four float32 arrays of
        :meth:`scratch_tails`' shapes after ``[b, n]``: the layer's part of the pass's stacked
        scratch), written there (a half model's values, exactly), and None. The kernels read
        contiguous copies of xBC, x and B: those are the copies written into ``into``, so a pass
        that stacks nothing afterwards copies no more than one that does. ``chain``: the nodes are
        a chain (``scan="chain"``) and the scan is its recurrence
        (:func:`~stree.kernels.multistep_update`'s), not each node's path. ``states``: the conv and
        SSM states' arrays where the caller has them (:attr:`~stree.models.cache.SSMLayerState.arrays`)."""
        wide = proj if proj.dtype == torch.float32 else proj.float()
        rows, nodes = proj.shape[0], proj.shape[1]
        arrays = into if into is not None else tuple(np.empty((rows, nodes, *tail), dtype=np.float32)
                                                     for tail in self.scratch_tails())
        lo, hi = float(dt_limit[0]), float(dt_limit[1])
        pa = parents if isinstance(parents, np.ndarray) else as_numpy(parents)
        scan_work, conv_work = self._node_work
        if not (parallel_rows(rows, rows * nodes * scan_work) or parallel_rows(rows, rows * nodes * conv_work)):
            # (two compiled calls: see .layer_jit) The conv's output and the gate (z) lie in one buffer,
            # whose SiLU is then one vectorised call: a second, of z's strided slice, and the slice and
            # conversion around it had cost a pass's layer more than its conv. The scan's state term,
            # where the tiled product makes it (.tree_jit.tiled_state), lies in the same buffer after them.
            made = not chain and tiled_state(nodes, self.d_state) and ssm_state.is_contiguous()
            per_node = self.dim + self.d_inner
            both_t, both = _empty_pair((rows * nodes * (per_node + (self.heads * self.headdim if made else 0)),))
            split, end = rows * nodes * self.dim, rows * nodes * per_node
            conv, gate = both[:split].reshape(rows, nodes, self.dim), both[split:end].reshape(rows, nodes, self.d_inner)
            tree_layer_in(as_numpy(wide), self.d_inner, pa, _state(self._wide(conv_state), states[0], conv_state),
                          self.conv_weight, self.conv_bias, self.has_conv_bias, arrays[0], arrays[2], conv, gate)
            F.silu(both_t[:end] if made else both_t, inplace=True)  # (vectorised, as the public kernels')
            _round(conv, self.dtype)
            xs = NOT_MADE
            if made:
                xs = both[end:].reshape(rows, nodes, self.heads, self.headdim)
                c_at = self.x_dim + self.B_dim
                start = both_t.data_ptr()  # (addresses from the tensors: a NumPy array's cost microseconds)
                gemm.state_term_unchecked(start + 4 * c_at, rows, nodes, (self.dim - c_at) // self.d_state,
                                          self.d_state, self.dim, nodes * self.dim, ssm_state.data_ptr(), self.heads,
                                          self.headdim, start + 4 * end)
            out, out_a = _empty_pair((rows, nodes, self.d_inner))
            tree_layer_out(conv, self.x_dim, self.B_dim, arrays[2], self.A, self.D, self.dt_bias, lo, hi, pa,
                           _state(ssm_state, states[1]), xs, made, chain, self._rounding, arrays[1], arrays[3], gate,
                           self.norm_weight, self.eps, self.gate_first, out_a)
            out = out if self.dtype == torch.float32 else out.to(self.dtype)
        else:
            out = self._tree_in_parallel(wide, pa, conv_state, ssm_state, lo, hi, arrays, chain)
        scratch = None if into is not None else tuple(torch.from_numpy(a).to(self.dtype) for a in arrays)
        return out, scratch

    def _tree_in_parallel(self, wide, pa, conv_state, ssm_state, lo, hi, arrays, chain) -> torch.Tensor:
        """:meth:`tree` on the separate kernels, whose drivers run rows with enough work in parallel."""
        _, xBC, dt = self._split(as_numpy(wide))
        np.copyto(arrays[0], xBC)
        np.copyto(arrays[2], dt)
        conv_t = torch.empty(xBC.shape, dtype=torch.float32)
        tree_conv_rows(arrays[0], pa, as_numpy(self._wide(conv_state)), self.conv_weight, self.conv_bias,
                       self.has_conv_bias, as_numpy(conv_t))
        F.silu(conv_t, inplace=True)
        conv = as_numpy(conv_t)
        _round(conv, self.dtype)
        x, B, C = self._ssm_inputs(conv)
        np.copyto(arrays[1], x)
        np.copyto(arrays[3], B)
        y = aligned_array(x.shape)  # (the scan adds into y's rows in place)
        if chain:
            chain_scan_rows(arrays[1], arrays[2], self.A, arrays[3], C, self.D, True, self.dt_bias, True, True, lo, hi,
                            as_numpy(ssm_state), True, y)
        else:
            tree_scan_rows(arrays[1], arrays[2], self.A, arrays[3], C, self.D, True, self.dt_bias, True, True, lo, hi,
                           pa, as_numpy(ssm_state), True, y)
        _round(y, self.dtype)
        return self._gated_norm(y, wide)

    # -- a step: one token a row, the states advanced in place --------------------------------
    def step(self, proj: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, dt_limit,
             states: tuple = (None, None)) -> torch.Tensor:
        """:func:`~stree.kernels.conv_step` with SiLU, :func:`~stree.kernels.selective_state_update`
        (as :meth:`tree`) and the gated norm of proj ``[b, ...]``, advancing conv_state
        ``[b, dim, K]`` and ssm_state ``[b, h, p, s]``: the norm's output ``[b, d_inner]``.
        ``states``: as :meth:`tree`'s."""
        wide = self._wide(proj)
        _, xBC, dt = self._split(as_numpy(wide))
        conv_wide = self._wide(conv_state)  # (a half state advances in a float32 copy, copied back: a shift)
        conv = np.empty(xBC.shape, dtype=np.float32)
        conv_step_rows(xBC, _state(conv_wide, states[0], conv_state), self.conv_weight, self.conv_bias,
                       self.has_conv_bias, True, conv)
        if conv_wide is not conv_state:
            conv_state.copy_(conv_wide)
        _round(conv, self.dtype)
        x, B, C = self._ssm_inputs(conv)
        y = np.empty(x.shape, dtype=np.float32)
        state_update_rows(_state(ssm_state, states[1]), x, dt, self.A, B, C, self.D, True, self.dt_bias, True, True,
                          float(dt_limit[0]), float(dt_limit[1]), y)
        _round(y, self.dtype)
        return self._gated_norm(y, wide)


def replay_in_place(ssm_state: torch.Tensor, conv_state: torch.Tensor, xBC: torch.Tensor, x: torch.Tensor,
                    dt: torch.Tensor, B: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor, accepted: torch.Tensor,
                    num_accepted: torch.Tensor, dt_limit: tuple[float, float]) -> None:
    """:func:`~stree.kernels.replay` of a stack of Mamba2 layers, in place, with softplus, for a
    model's commit: the states ``[L, b, ...]`` its cache holds (the conv state float32 or, a half
    model's, of its dtype), the activations ``[L, b, n, ...]`` its pass made, ``A`` and
    ``dt_bias`` ``[L, h]``, all else CPU float32; ``accepted [b, D]`` and ``num_accepted [b]``
    int64, the paths the model checked. The public kernel's checks and conversions took a small
    model's commit about as long as the replay itself."""
    replay_arrays(ssm_state, conv_state, tuple(as_numpy(t) for t in (xBC, x, dt, B)), as_numpy(A), as_numpy(dt_bias),
                  accepted, num_accepted, dt_limit)


def replay_arrays(ssm_state: torch.Tensor, conv_state: torch.Tensor, scratch: tuple, A: np.ndarray,
                  dt_bias: np.ndarray, accepted: torch.Tensor, num_accepted: torch.Tensor,
                  dt_limit: tuple[float, float], states: tuple = (None, None)) -> None:
    """:func:`replay_in_place` of the activations ``scratch`` (xBC, x, dt, B), ``A`` and
    ``dt_bias`` as the float32 arrays they are (where the bound kernels wrote them: a commit then
    converts nothing of them); ``states``: the conv and SSM states' arrays where the caller has them
    (:attr:`~stree.models.cache.ModelCache.arrays`)."""
    state = _state(ssm_state, states[1])
    conv_wide = conv_state if conv_state.dtype == torch.float32 else conv_state.float()
    conv = _state(conv_wide, states[0], conv_state)
    replay_layers(state, conv, *scratch, A, dt_bias, True, True, float(dt_limit[0]), float(dt_limit[1]),
                  np.ascontiguousarray(as_numpy(accepted)), as_numpy(num_accepted), state, conv)
    if conv_wide is not conv_state:
        conv_state.copy_(conv_wide)  # (exact: the accepted nodes' inputs, half values)
