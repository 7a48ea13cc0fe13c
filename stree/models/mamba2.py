"""Mamba2 language model with mamba_ssm ``MambaLMHeadModel`` semantics and the tree-decoding
protocol: ``allocate_cache``, ``prefill``, ``step``, ``forward_tree`` (one pass over a token tree,
committed state untouched) and ``commit`` (activation replay of the accepted path).

Residual stream in fp32 (``residual_in_fp32``), fused add+norm semantics (the fp32 sum is
normalised and multiplied by the weight in fp32, rounded once), gated RMSNorm norm(y * silu(z))
over ``d_inner / ngroups`` channels, SSM state stored in fp32, ``dt_limit`` applied on every path
so that step, chain and tree verify compute the same function.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import multistep_update, replay, tree_conv1d, tree_scan
from ..tree import TokenTree, TreeIndex, leaf_paths
from .base import TreeLM
from .cache import ModelCache, SSMScratch
from .config import Mamba2Config


class RMSNorm(nn.Module):
    """fp32 arithmetic. ``round_before_weight``: HF LlamaRMSNorm rounds to the output dtype before
    the weight multiply; mamba_ssm's Triton norm multiplies in fp32 and rounds once."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None, round_before_weight: bool = False):
        super().__init__()
        self.eps = eps
        self.round_before_weight = round_before_weight
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.round_before_weight:
            return self.weight * normed.to(out_dtype)
        return (normed * self.weight.float()).to(out_dtype)


class GatedRMSNorm(RMSNorm):
    """norm(y * silu(z)) per group of ``group_size`` channels (mamba_ssm, norm_before_gate=False)."""

    def __init__(self, dim: int, group_size: int, eps: float, device=None, dtype=None):
        super().__init__(dim, eps, device, dtype)
        self.group_size = group_size

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        v = y.float() * F.silu(z.float())
        groups = v.unflatten(-1, (-1, self.group_size))
        v = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (v * self.weight.float()).to(y.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        f = dict(device=device, dtype=dtype)
        self.in_proj = nn.Linear(cfg.d_model, cfg.d_in_proj, bias=cfg.bias, **f)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias,
                                padding=cfg.d_conv - 1, **f)
        self.dt_bias = nn.Parameter(torch.empty(cfg.nheads, **f))
        self.A_log = nn.Parameter(torch.empty(cfg.nheads, **f))
        self.D = nn.Parameter(torch.ones(cfg.nheads, device=device))  # fp32, as mamba_ssm leaves it
        self.norm = GatedRMSNorm(cfg.d_inner, cfg.d_inner // cfg.ngroups, cfg.norm_eps, **f)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=cfg.bias, **f)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self, generator=None):
        """mamba_ssm's initialisation: A in [1, 16], dt in [1e-3, 0.1] log-uniform, D = 1."""
        n = self.cfg.nheads
        u = torch.rand(n, generator=generator)
        self.A_log.copy_(torch.log(1 + 15 * u))
        dt = torch.exp(torch.rand(n, generator=generator) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.D.fill_(1.0)

    def _split(self, u):
        cfg = self.cfg
        z, xBC, dt = torch.split(self.in_proj(u), [cfg.d_inner, cfg.conv_dim, cfg.nheads], dim=-1)
        return z, xBC, dt

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

    def _output(self, y, z):
        return self.out_proj(self.norm(y.flatten(-2), z))

    def A(self):
        return -torch.exp(self.A_log.float())

    def ssm_kwargs(self):
        return dict(dt_bias=self.dt_bias, dt_limit=self.cfg.dt_limit)

    def forward_tree(self, u, index: TreeIndex, conv_state, ssm_state, backend: str, kernel_backend: str):
        """Outputs for every node of the tree; the states are only read."""
        z, xBC, dt = self._split(u)
        conv_out = tree_conv1d(xBC, index, conv_state, self.conv1d.weight, self.conv1d.bias, backend=kernel_backend)
        x, B, C = self._ssm_inputs(conv_out)
        kw = dict(D=self.D, **self.ssm_kwargs(), backend=kernel_backend)
        if backend == "tree":
            y = tree_scan(x, dt, self.A(), B, C, index, initial_state=ssm_state, **kw)
        elif backend == "chain":
            y, _ = multistep_update(ssm_state, x, dt, self.A(), B, C, **kw)
        else:
            y = _unrolled_ssm(x, dt, self.A(), B, C, index, ssm_state, kw)
        return self._output(y, z), SSMScratch(xBC, x, dt, B)

    def step(self, u, conv_state, ssm_state, kernel_backend: str):
        """One token ``u [b, d]``; advances ``conv_state`` and ``ssm_state`` in place."""
        z, xBC, dt = self._split(u)
        conv_state.copy_(torch.cat([conv_state[..., 1:], xBC[..., None].to(conv_state.dtype)], dim=-1))
        w = self.conv1d.weight[:, 0].float()
        conv = (conv_state.float() * w).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias.float()
        x, B, C = self._ssm_inputs(F.silu(conv).to(xBC.dtype)[:, None])
        y, new_state = multistep_update(ssm_state, x, dt[:, None], self.A(), B, C, D=self.D, **self.ssm_kwargs(),
                                        backend=kernel_backend)
        ssm_state.copy_(new_state)
        return self._output(y[:, 0], z)

    def replay(self, scratch: SSMScratch, conv_state, ssm_state, accepted, num_accepted, kernel_backend: str):
        # The model checked accepted / num_accepted once for all layers (TreeLM.check_commit).
        new_ssm, new_conv = replay(ssm_state, conv_state, scratch.xBC, scratch.x, scratch.dt, scratch.B, self.A(),
                                   accepted, num_accepted, **self.ssm_kwargs(), validate=False,
                                   backend=kernel_backend)
        ssm_state.copy_(new_ssm)
        conv_state.copy_(new_conv)


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


class Mamba2Block(nn.Module):
    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device, dtype)
        self.mixer = Mamba2Mixer(cfg, device, dtype)


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.embedding = nn.Embedding(cfg.padded_vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Mamba2Block(cfg, device, dtype) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, device, dtype)


class Mamba2LM(TreeLM):
    """Parameter names are mamba_ssm's (``backbone.embedding``, ``backbone.layers.i.mixer.*``)."""

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.backbone = Mamba2Backbone(cfg, device, dtype)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def _run(self, tokens, mixer_fn):
        """Embedding, blocks (fused add+norm semantics), final norm and head; ``mixer_fn(i, mixer, h)``."""
        hidden = self.backbone.embedding(tokens)
        residual = None
        for i, layer in enumerate(self.backbone.layers):
            residual = hidden if residual is None else hidden + residual
            if self.cfg.residual_in_fp32:
                residual = residual.float()
            hidden = mixer_fn(i, layer.mixer, layer.norm(residual, self.dtype))
        return self.lm_head(self.backbone.norm_f(hidden + residual, self.dtype))

    def allocate_cache(self, batch_size: int, max_length: int) -> ModelCache:
        cfg = self.cfg
        return ModelCache(
            conv=torch.zeros(cfg.n_layer, batch_size, cfg.conv_dim, cfg.d_conv, device=self.device, dtype=self.dtype),
            ssm=torch.zeros(cfg.n_layer, batch_size, cfg.nheads, cfg.headdim, cfg.d_state, device=self.device),
            k=None, v=None,
            seqlens=torch.zeros(batch_size, dtype=torch.long, device=self.device),
            max_length=max_length,
            scratch=[None] * cfg.n_layer,
        )

    def tree_pass(self, tree: TokenTree, index, cache: ModelCache, backend: str, kernel_backend: str) -> torch.Tensor:
        def mixer_fn(i, mixer, h):
            out, cache.scratch[i] = mixer.forward_tree(h, index, cache.conv[i], cache.ssm[i], backend, kernel_backend)
            return out

        logits = self._run(tree.tokens, mixer_fn)
        cache.tree_n = tree.n
        return logits

    @torch.no_grad()
    def commit(self, cache: ModelCache, tree: TokenTree, accepted: torch.Tensor, num_accepted: torch.Tensor):
        """Advance each row by its accepted path (root first) by activation replay."""
        self.check_commit(cache, tree, accepted, num_accepted)
        for i, layer in enumerate(self.backbone.layers):
            layer.mixer.replay(cache.scratch[i], cache.conv[i], cache.ssm[i], accepted, num_accepted,
                               self.kernel_backend)
        self.finish_commit(cache, num_accepted)

    def step_pass(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """Conv shift and one fused recurrence step per layer."""
        return self._run(tokens, lambda i, mixer, h: mixer.step(h, cache.conv[i], cache.ssm[i], self.kernel_backend))
