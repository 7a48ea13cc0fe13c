"""The Mamba2 mixer (mamba_ssm semantics) with the tree-decoding protocol: ``tree`` (every node of a
token tree in one pass, the committed state only read, the activations replay needs kept),
``step`` (one token, the state advanced in place) and ``commit_layers`` (activation replay of the
accepted path, every Mamba2 layer in one call).

Gated RMSNorm norm(y * silu(z)) over ``d_inner / ngroups`` channels, SSM state stored in fp32,
``dt_limit`` applied on every path so that step, chain and tree verify compute the same function
(families whose reference clamps in prefill only set ``dt_limit_prefill_only``: then decoding never
clamps, prefill always does).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ...kernels import conv_step, multistep_update, replay, selective_state_update, tree_conv1d, tree_scan
from ...kernels._common import FLOAT_DTYPES, as_numpy
from ...kernels.cpu.bound import Mamba2LayerJit, aligned_array, replay_arrays, replay_in_place
from ...tree import PackedTrees, TreeIndex, leaf_paths
from ..base import derived, value_key
from ..cache import SSMLayerState, SSMScratch
from ..config import Mamba2Config
from .linear import Linear
from .norms import GatedRMSNorm, SiluGate


class Mamba2Mixer(nn.Module):
    kind = "ssm"

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        f = dict(device=device, dtype=dtype)
        self.in_proj = Linear(cfg.d_model, cfg.d_in_proj, bias=cfg.bias, **f)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias,
                                padding=cfg.d_conv - 1, **f)
        self.dt_bias = nn.Parameter(torch.empty(cfg.nheads, **f))
        self.A_log = nn.Parameter(torch.empty(cfg.nheads, **f))
        self.D = nn.Parameter(torch.ones(cfg.nheads, device=device))  # fp32, as mamba_ssm leaves it
        if cfg.gate_norm == "none":
            self.norm = SiluGate()
        else:
            self.norm = GatedRMSNorm(cfg.d_inner, cfg.d_inner // cfg.ngroups, cfg.norm_eps, **f,
                                     round_before_weight=cfg.norm_round_before_weight,
                                     gate_first=cfg.gate_norm == "gate_first")
        self.out_proj = Linear(cfg.d_inner, cfg.d_model, bias=cfg.out_bias, **f)
        self.reset_ssm_parameters()
        if cfg.proj_scales is not None:
            self.register_buffer("mup_vector", self.proj_multipliers(device, dtype), persistent=False)

    def compile_layout(self) -> None:
        """Lay the conv weight out taps-major (stride 1 along the channels; the same values in the
        same Parameter), as :class:`~stree.runtime.CompiledModel` wants it: Inductor vectorises the
        tree conv's taps along the channels only where they are contiguous there (laid out as
        ``nn.Conv1d`` makes it, its gather ran one channel at a time). Every other path takes any
        strides, and a checkpoint is written contiguous."""
        weight = self.conv1d.weight
        if weight.shape[0] > 1 and weight.stride(0) != 1:
            with torch.no_grad():
                weight.data = weight.detach().permute(2, 1, 0).contiguous().permute(2, 1, 0)

    def proj_multipliers(self, device=None, dtype=None) -> torch.Tensor:
        """Falcon-H1's ``mup_vector``: each in_proj output segment's multiplier, per channel."""
        cfg = self.cfg
        sizes = (cfg.d_inner, cfg.x_dim, cfg.B_dim, cfg.C_dim, cfg.nheads)
        return torch.cat([torch.full((n,), v) for n, v in zip(sizes, cfg.proj_scales)]).to(device, dtype)

    def make_buffers(self, device) -> None:
        """The buffers no checkpoint holds (``mup_vector``), after loading on "meta"."""
        if self.cfg.proj_scales is not None:
            self.mup_vector = self.proj_multipliers(device, self.in_proj.weight.dtype)

    @torch.no_grad()
    def reset_ssm_parameters(self, generator=None):
        """mamba_ssm's initialisation: A in [1, 16], dt in [1e-3, 0.1] log-uniform, D = 1."""
        n = self.cfg.nheads
        u = torch.rand(n, generator=generator)
        self.A_log.copy_(torch.log(1 + 15 * u))
        dt = torch.exp(torch.rand(n, generator=generator) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.D.fill_(1.0)

    def _proj(self, u):
        """The in_proj output: z, xBC and dt side by side (:meth:`_split`)."""
        proj = self.in_proj(u)
        return proj * self.mup_vector if self.cfg.proj_scales is not None else proj

    def _split(self, proj):
        cfg = self.cfg
        return torch.split(proj, [cfg.d_inner, cfg.conv_dim, cfg.nheads], dim=-1)

    def _ssm_inputs(self, conv_out):
        """Split the conv output into x ``[.., h, p]``, B and C ``[.., g, s]``; in the d_xb variant
        x and B hold one head / group per KV head and are repeated (head h reads h // repeat)."""
        cfg = self.cfg
        x, B, C = torch.split(conv_out, [cfg.x_dim, cfg.B_dim, cfg.C_dim], dim=-1)
        x = x.unflatten(-1, (cfg.x_dim // cfg.headdim, cfg.headdim))
        B = B.unflatten(-1, (cfg.B_dim // cfg.d_state, cfg.d_state))
        if cfg.d_xb is not None:
            x = x.repeat_interleave(cfg.nheads // x.shape[-2], dim=-2)
            B = B.repeat_interleave(cfg.ngroups // B.shape[-2], dim=-2)
        return x, B, C.unflatten(-1, (cfg.ngroups, cfg.d_state))

    def _output(self, y, z, backend: str):
        return self.out_proj(self.norm(y.flatten(-2), z, backend))

    def A(self):
        """-exp(A_log) in fp32, computed once per value of A_log."""
        return derived(self.A_log, "A", lambda: -torch.exp(self.A_log.float()))

    def dt_limit(self, prefill: bool) -> tuple[float, float]:
        """The dt clamp of a prefill or a decoding pass (see Mamba2Config.dt_limit_prefill_only)."""
        return self.cfg.dt_limit if prefill or not self.cfg.dt_limit_prefill_only else (0.0, math.inf)

    def ssm_kwargs(self, prefill: bool = False):
        return dict(dt_bias=self.dt_bias, dt_limit=self.dt_limit(prefill))

    def bound(self, backend: str, proj: torch.Tensor, state: SSMLayerState) -> Mamba2LayerJit | None:
        """The layer's numba kernels bound to its parameters, where a decoding pass may call them
        directly (:class:`~stree.kernels.cpu.bound.Mamba2LayerJit`: the public kernels' results
        without their per-call checks): CPU activations (``proj``, the in_proj output) of float32,
        or float16 / bfloat16 with parameters and conv state of that dtype or float32 (a half
        model: its parameters bound widened), a float32 SSM state, the "auto" kernels, no gradient,
        no graph being compiled, a gated norm of the whole layer (not a tensor-parallel rank's),
        rounded as its public kernel rounds; else None."""
        norm, dtype = self.norm, proj.dtype
        if (backend != "auto" or dtype not in FLOAT_DTYPES or not proj.is_cpu
                or state.conv.dtype not in (dtype, torch.float32) or state.ssm.dtype != torch.float32
                or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or not isinstance(norm, GatedRMSNorm) or norm.tp is not None
                or (norm.round_before_weight and dtype != torch.float32)):
            return None
        params = self._bound_params()
        return derived(self, "bound", lambda: self._bind(dtype),
                       key=(dtype, *value_key(*(t for t in params if t is not None))))

    def _bound_params(self) -> tuple:
        # (read from the modules' parameter dicts: through nn.Module's attribute lookup, the six took
        # half of what finding the bound kernels costs a step's layer; one kept elsewhere, as a
        # parametrization keeps it, is the attribute's)
        own, conv, norm = self._parameters, self._modules["conv1d"]._parameters, self._modules["norm"]._parameters
        try:
            return conv["weight"], conv["bias"], own["A_log"], own["D"], own["dt_bias"], norm["weight"]
        except KeyError:
            return self.conv1d.weight, self.conv1d.bias, self.A_log, self.D, self.dt_bias, self.norm.weight

    def _bind(self, dtype: torch.dtype) -> Mamba2LayerJit | None:
        if not all(t is None or (t.is_cpu and t.dtype in (dtype, torch.float32)) for t in self._bound_params()):
            return None
        norm, cfg = self.norm, self.cfg
        wide = lambda t: None if t is None else t.float()  # (exact; itself where it is float32)
        return Mamba2LayerJit(wide(self.conv1d.weight), wide(self.conv1d.bias), self.A(), wide(self.D),
                              wide(self.dt_bias), wide(norm.weight), norm.group_size, norm.eps, norm.gate_first,
                              x_dim=cfg.x_dim, B_dim=cfg.B_dim, d_state=cfg.d_state, dtype=dtype)

    def tree(self, u, ctx, state: SSMLayerState):
        """Outputs for every node of the tree and the activations replay needs; state only read."""
        proj = self._proj(u)
        # Packed trees (scan "tree") take the bound kernels on the padded layout, their padding nodes
        # leaves under the root whose outputs are dropped, while the products (in_proj before, out_proj
        # after) take the packed nodes alone; the scratch is then padded, as commit's bound replay reads
        # it (a path's node indices are the same in both layouts)
        packed = isinstance(ctx.index, PackedTrees)
        index = ctx.index.padded if packed and ctx.scan == "tree" else ctx.index
        if ctx.scan in ("tree", "chain") and isinstance(index, TreeIndex) and Mamba2LayerJit.takes_tree(index):
            jit = self.bound(ctx.kernel_backend, proj, state)
            if jit is not None:
                laid = ctx.index.unpack(proj) if packed else proj
                out, scratch = jit.tree(laid, _parents(index), state.conv, state.ssm, self.dt_limit(ctx.prefill),
                                        _slots(ctx, state.index, jit, laid.shape[:-1]), chain=ctx.scan == "chain",
                                        states=state.arrays)
                return self.out_proj(ctx.index.pack(out) if packed else out), scratch
        z, xBC, dt = self._split(proj)
        conv_out = tree_conv1d(xBC, ctx.index, state.conv, self.conv1d.weight, self.conv1d.bias,
                               backend=ctx.kernel_backend)
        x, B, C = self._ssm_inputs(conv_out)
        kw, A = dict(D=self.D, **self.ssm_kwargs(ctx.prefill), backend=ctx.kernel_backend), self.A()
        if ctx.scan == "tree":
            y = tree_scan(x, dt, A, B, C, ctx.index, initial_state=state.ssm, **kw)
        elif ctx.scan == "chain":
            y, _ = multistep_update(state.ssm, x, dt, A, B, C, **kw)
        else:
            y = _unrolled_ssm(x, dt, A, B, C, ctx.index, state.ssm, kw)
        return self._output(y, z, ctx.kernel_backend), (xBC, x, dt, B, A, self.dt_bias.float())

    def step(self, u, state: SSMLayerState, ctx):
        """One token ``u [b, d]``; advances the layer's conv and SSM state in place."""
        proj = self._proj(u)
        jit = self.bound(ctx.kernel_backend, proj, state)
        if jit is not None:
            return self.out_proj(jit.step(proj, state.conv, state.ssm, self.dt_limit(False), state.arrays))
        z, xBC, dt = self._split(proj)
        conv = conv_step(xBC, state.conv, self.conv1d.weight, self.conv1d.bias, backend=ctx.kernel_backend)
        x, B, C = self._ssm_inputs(conv)
        y = selective_state_update(state.ssm, x, dt, self.A(), B, C, D=self.D, **self.ssm_kwargs(),
                                   backend=ctx.kernel_backend)
        return self._output(y, z, ctx.kernel_backend)

    @staticmethod
    def stack_scratch(per_layer) -> SSMScratch:
        return SSMScratch(*(torch.stack(parts) for parts in zip(*per_layer)))

    @staticmethod
    def commit_layers(model, cache, scratch: SSMScratch, accepted, num_accepted, kernel_backend: str, prefill: bool,
                      cu_seqlens=None):
        """Activation replay of every Mamba2 layer in one call (the model checked the path), with
        the dt clamp the pass used (``cu_seqlens``: the pass was packed trees'; where the bound
        kernels wrote its scratch, that is padded, and replayed as a padded pass's)."""
        mixers = [blk.mixer for blk, kind in zip(model.blocks, model.kinds()) if kind == "ssm"]
        dt_limit = mixers[0].dt_limit(prefill)
        kernels = scratch.kernels
        on_host = kernel_backend == "auto" and accepted.dtype == num_accepted.dtype == torch.long and accepted.is_cpu \
            and num_accepted.is_cpu
        if on_host and kernels is not None and None not in kernels:
            # every layer's bound kernels wrote the scratch (their preconditions hold of this cache: the
            # model checked it is the pass's): their parameters and the scratch's arrays as they are
            A, dt_bias = derived(model, "ssm_replay_constants", lambda: tuple(np.stack(p) for p in zip(
                *((k.A, k.dt_bias) for k in kernels))), key=tuple(kernels))
            replay_arrays(cache.ssm, cache.conv, scratch.arrays, A, dt_bias, accepted, num_accepted, dt_limit,
                          cache.arrays)
            return
        if scratch.A is not None:
            A, dt_bias = scratch.A, scratch.dt_bias
        else:  # (layers of one pass that took the bound kernels and others that did not)
            A, dt_bias = derived(model, "ssm_A_dt_bias", lambda: (torch.stack([m.A() for m in mixers]),
                                                                  torch.stack([m.dt_bias for m in mixers])),
                                 key=value_key(*(m.A_log for m in mixers), *(m.dt_bias for m in mixers)))
        wide = (cache.ssm, *scratch.parts(), A)  # (float32 for the kernel; a half model's conv state and dt_bias not)
        if on_host and cu_seqlens is None and cache.conv.dtype in FLOAT_DTYPES \
                and all(t.dtype == torch.float32 for t in wide) \
                and all(t.is_cpu and not t.requires_grad for t in (*wide, cache.conv, dt_bias)):
            # (the public replay's checks: the model's; a half model's scratch is the bound kernels' float32
            # arrays, its dt_bias widened exactly)
            replay_in_place(cache.ssm, cache.conv, *scratch.parts(), A,
                            dt_bias if dt_bias.dtype == torch.float32 else dt_bias.float(), accepted, num_accepted,
                            dt_limit)
            return
        replay(cache.ssm, cache.conv, *scratch.parts(), A, accepted, num_accepted,
               dt_bias=dt_bias, dt_limit=dt_limit, validate=False, out=(cache.ssm, cache.conv),
               cu_seqlens=cu_seqlens, backend=kernel_backend)


def _parents(index: TreeIndex):
    """The tree's parents as the array the bound kernels read, made once for a pass's layers (each
    layer's ``.numpy()`` was four dispatcher calls)."""
    return index.memo("parents_array", lambda: as_numpy(index.parents))


def _slots(ctx, k: int, jit: Mamba2LayerJit, lead: torch.Size) -> tuple:
    """Layer ``k``'s part of the pass's stacked scratch (``ctx.ssm_scratch``, made here by the first
    layer to write one), as the arrays the bound kernels copy their activations into. Each layer's
    returned and stacked after them, the stack's copies and the tensors around them took 3-5% of the
    shipped target's tree passes on the CPU, the more the more nodes (docs/kernels.md)."""
    scratch = ctx.ssm_scratch
    if scratch is None:  # (arrays handed to torch: a tensor's .numpy() is four dispatcher calls)
        arrays = tuple(aligned_array((ctx.ssm_layers, *lead, *tail)) for tail in jit.scratch_tails())
        scratch = ctx.ssm_scratch = SSMScratch(*(torch.from_numpy(a) for a in arrays))
        scratch.arrays, scratch.kernels = arrays, [None] * ctx.ssm_layers
    scratch.kernels[k] = jit
    xBC, x, dt, B = scratch.arrays
    return xBC[k], x[k], dt[k], B[k]


def _unrolled_ssm(x, dt, A, B, C, index: TreeIndex, ssm_state, kw):
    """The baseline STree replaces: every root-to-leaf path as its own sequence from the state."""
    batch = x.shape[0]
    rows = index.parents.tolist()
    pairs = [(b, p) for b in range(batch) for p in leaf_paths(rows[b if len(rows) > 1 else 0])]
    length = max(len(p) for _, p in pairs)
    idx = torch.tensor([p + [p[-1]] * (length - len(p)) for _, p in pairs], device=x.device)
    row = torch.tensor([b for b, _ in pairs], device=x.device)
    real = torch.tensor([[t < len(p) for t in range(length)] for _, p in pairs], device=x.device)
    take = lambda t: t[row[:, None], idx]
    y_paths, _ = multistep_update(ssm_state[row], take(x), take(dt), A, take(B), take(C), **kw)
    y = torch.empty_like(x)
    y[row[:, None].expand_as(idx)[real], idx[real]] = y_paths[real]
    return y
