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

from ..kernels import MAX_TREE_NODES, multistep_update, replay, tree_conv1d, tree_scan
from ..tree import TokenTree, TreeIndex, TreeShape, leaf_paths
from .cache import Mamba2Cache, SSMScratch
from .config import Mamba2Config

TREE_BACKENDS = ("tree", "chain", "unrolled")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(out_dtype)


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
        cfg = self.cfg
        gs = cfg.ngroups * cfg.d_state
        x, B, C = torch.split(conv_out, [cfg.d_inner, gs, gs], dim=-1)
        return (x.unflatten(-1, (cfg.nheads, cfg.headdim)), B.unflatten(-1, (cfg.ngroups, cfg.d_state)),
                C.unflatten(-1, (cfg.ngroups, cfg.d_state)))

    def _output(self, y, z):
        return self.out_proj(self.norm(y.flatten(-2), z))

    def A(self):
        return -torch.exp(self.A_log.float())

    def ssm_kwargs(self):
        return dict(dt_bias=self.dt_bias, dt_limit=self.cfg.dt_limit)

    def forward_tree(self, u, index: TreeIndex, conv_state, ssm_state, backend: str, kernel_backend: str):
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
        new_ssm, new_conv = replay(ssm_state, conv_state, scratch.xBC, scratch.x, scratch.dt, scratch.B, self.A(),
                                   accepted, num_accepted, **self.ssm_kwargs(), backend=kernel_backend)
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


class Mamba2LM(nn.Module):
    """Parameter names are mamba_ssm's (``backbone.embedding``, ``backbone.layers.i.mixer.*``)."""

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.backbone = Mamba2Backbone(cfg, device, dtype)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight
        self.kernel_backend = "auto"  # "triton" forces the Triton kernels (tests: under the interpreter)

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.backbone.embedding.weight.device

    def _check_tokens(self, name, tokens):
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.device != self.device:
            raise ValueError(f"{name} is on {tokens.device} but the model is on {self.device}")
        bad = (tokens < 0) | (tokens >= self.cfg.padded_vocab_size)
        if bool(bad.any()):
            pos = tuple(int(v) for v in torch.nonzero(bad)[0])
            raise ValueError(f"{name}{list(pos)} = {int(tokens[pos])} is outside the vocabulary [0, {self.cfg.padded_vocab_size})")

    def _check_cache(self, cache: Mamba2Cache, batch: int, new_tokens: int):
        if cache.batch_size != batch:
            raise ValueError(f"the cache holds {cache.batch_size} rows but the input has batch {batch}")
        longest = int(cache.seqlens.max()) + new_tokens
        if longest > cache.max_length:
            raise ValueError(f"sequence would reach {longest} tokens, past the cache's max_length {cache.max_length}")

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

    def allocate_cache(self, batch_size: int, max_length: int) -> Mamba2Cache:
        cfg = self.cfg
        return Mamba2Cache(
            conv=torch.zeros(cfg.n_layer, batch_size, cfg.conv_dim, cfg.d_conv, device=self.device, dtype=self.dtype),
            ssm=torch.zeros(cfg.n_layer, batch_size, cfg.nheads, cfg.headdim, cfg.d_state, device=self.device),
            seqlens=torch.zeros(batch_size, dtype=torch.long, device=self.device),
            max_length=max_length,
            scratch=[None] * cfg.n_layer,
        )

    @torch.no_grad()
    def forward_tree(self, tree: TokenTree, cache: Mamba2Cache, backend: str = "tree") -> torch.Tensor:
        """Logits ``[b, n, V]`` at every tree node; the committed state is not changed."""
        if backend not in TREE_BACKENDS:
            raise ValueError(f"backend must be one of {TREE_BACKENDS}, got {backend!r}")
        self._check_tokens("tree.tokens", tree.tokens)
        index = tree.index
        self._check_cache(cache, tree.batch_size, int(index.depth.max()) + 1)
        if backend == "chain" and not bool((index.depth == torch.arange(tree.n, device=index.device)).all()):
            raise ValueError("backend='chain' needs a chain tree (parents[i] == i - 1)")

        def mixer_fn(i, mixer, h):
            out, cache.scratch[i] = mixer.forward_tree(h, index, cache.conv[i], cache.ssm[i], backend,
                                                       self.kernel_backend)
            return out

        logits = self._run(tree.tokens, mixer_fn)
        cache.tree_n = tree.n
        return logits

    @torch.no_grad()
    def commit(self, cache: Mamba2Cache, tree: TokenTree, accepted: torch.Tensor, num_accepted: torch.Tensor):
        """Advance each row by its accepted path (root first) by activation replay."""
        if cache.tree_n != tree.n or any(s is None for s in cache.scratch):
            raise ValueError("commit needs the forward_tree pass of this same tree just before it")
        for i, layer in enumerate(self.backbone.layers):
            layer.mixer.replay(cache.scratch[i], cache.conv[i], cache.ssm[i], accepted, num_accepted,
                               self.kernel_backend)
        cache.seqlens += num_accepted.to(cache.seqlens.device)
        cache.scratch = [None] * len(cache.scratch)
        cache.tree_n = None

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: Mamba2Cache) -> torch.Tensor:
        """Feed one token per row (``[b]``); returns next-token logits ``[b, V]``."""
        self._check_tokens("tokens", tokens)
        self._check_cache(cache, tokens.shape[0], 1)
        logits = self._run(tokens, lambda i, mixer, h: mixer.step(h, cache.conv[i], cache.ssm[i], self.kernel_backend))
        cache.seqlens += 1
        return logits

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: Mamba2Cache, lengths: torch.Tensor | None = None,
                chunk: int = MAX_TREE_NODES) -> torch.Tensor:
        """Feed right-padded prompts ``[b, T]`` (row b's first ``lengths[b] >= 1`` tokens) in chains
        of at most ``chunk`` tokens; returns the logits after each row's last token ``[b, V]``."""
        self._check_tokens("input_ids", input_ids)
        batch, T = input_ids.shape
        lengths = torch.full((batch,), T) if lengths is None else lengths.cpu()
        if tuple(lengths.shape) != (batch,) or bool(((lengths < 1) | (lengths > T)).any()):
            raise ValueError(f"lengths must be [batch] with 1 <= lengths <= {T}, got {lengths.tolist()}")
        if not 1 <= chunk <= MAX_TREE_NODES:
            raise ValueError(f"chunk must be in [1, {MAX_TREE_NODES}], got {chunk}")
        self._check_cache(cache, batch, int(lengths.max()))
        last = torch.empty(batch, self.cfg.padded_vocab_size, device=self.device, dtype=self.dtype)
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            counts = (lengths - start).clamp(0, end - start)
            rows = torch.nonzero(counts > 0).flatten()
            sub = cache if len(rows) == batch else cache.select(rows.to(self.device))
            shape = TreeShape.chain(end - start - 1)
            tree = TokenTree.from_shape(shape, input_ids[rows.to(self.device), start:end])
            logits = self.forward_tree(tree, sub)
            n = counts[rows].to(self.device)
            self.commit(sub, tree, torch.arange(end - start, device=self.device).expand(len(rows), -1), n)
            if sub is not cache:
                cache.assign(rows.to(self.device), sub)
            ends_here = (lengths[rows] <= end).to(self.device)
            pick = torch.nonzero(ends_here).flatten()
            last[rows.to(self.device)[pick]] = logits[pick, n[pick] - 1]
        return last

