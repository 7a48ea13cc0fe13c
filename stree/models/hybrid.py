"""MambaInLlama hybrid: Llama pre-norm blocks with a SwiGLU MLP, the token mixer being GQA
attention (RoPE at ``prefix_len + depth``) at ``attn_layers`` and Mamba2 (d_xb variant) elsewhere.
Residual stream in model dtype. HF Llama parameter names (``model.layers.i.self_attn.*``,
``model.layers.i.mamba.*``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tree import TokenTree, TreeIndex
from .attention import LlamaAttention
from .base import TreeLM
from .cache import ModelCache
from .config import HybridConfig
from .mamba2 import Mamba2Mixer, RMSNorm


class SwiGLU(nn.Module):
    def __init__(self, d_model, intermediate_size, device=None, dtype=None):
        super().__init__()
        f = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(d_model, intermediate_size, **f)
        self.up_proj = nn.Linear(d_model, intermediate_size, **f)
        self.down_proj = nn.Linear(intermediate_size, d_model, **f)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, attention: bool, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype)
        self.mlp = SwiGLU(cfg.d_model, cfg.intermediate_size, device, dtype)
        if attention:
            self.self_attn = LlamaAttention(cfg.d_model, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                            cfg.rope_theta, cfg.rope_scaling, device, dtype)
        else:
            self.mamba = Mamba2Mixer(cfg.mamba, device, dtype)


class HybridBody(nn.Module):
    def __init__(self, cfg: HybridConfig, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(HybridLayer(cfg, i in cfg.attn_layers, device, dtype) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype, round_before_weight=True)


class HybridLM(TreeLM):
    def __init__(self, cfg: HybridConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.model = HybridBody(cfg, device, dtype)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Position of each layer's state in the cache's stacked SSM / attention tensors.
        self._slot = {i: cfg.ssm_layers.index(i) if i in cfg.ssm_layers else cfg.attn_layers.index(i)
                      for i in range(cfg.n_layer)}

    def allocate_cache(self, batch_size: int, max_length: int) -> ModelCache:
        cfg, m = self.cfg, self.cfg.mamba
        ns, na = len(cfg.ssm_layers), len(cfg.attn_layers)
        kv = (na, batch_size, max_length, cfg.num_key_value_heads, cfg.head_dim)
        return ModelCache(
            conv=torch.zeros(ns, batch_size, m.conv_dim, m.d_conv, device=self.device, dtype=self.dtype),
            ssm=torch.zeros(ns, batch_size, m.nheads, m.headdim, m.d_state, device=self.device),
            k=torch.zeros(kv, device=self.device, dtype=self.dtype),
            v=torch.zeros(kv, device=self.device, dtype=self.dtype),
            seqlens=torch.zeros(batch_size, dtype=torch.long, device=self.device),
            max_length=max_length,
            scratch=[None] * cfg.n_layer,
        )

    def _run(self, tokens, mix):
        """Embedding, pre-norm blocks and head; ``mix(i, layer, x)`` is layer i's token mixer."""
        hidden = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            hidden = hidden + mix(i, layer, layer.input_layernorm(hidden, hidden.dtype))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden, hidden.dtype))
        return self.lm_head(self.model.norm(hidden, hidden.dtype))

    def tree_pass(self, tree: TokenTree, index, cache: ModelCache, backend: str, kernel_backend: str) -> torch.Tensor:
        positions = cache.seqlens[:, None] + tree.depth

        def mix(i, layer, x):
            s = self._slot[i]
            if i in self.cfg.attn_layers:
                x, cache.scratch[i] = layer.self_attn.forward_tree(x, positions, index, cache.k[s], cache.v[s],
                                                                   cache.seqlens, kernel_backend)
            else:
                x, cache.scratch[i] = layer.mamba.forward_tree(x, index, cache.conv[s], cache.ssm[s], backend,
                                                               kernel_backend)
            return x

        logits = self._run(tree.tokens, mix)
        cache.tree_n = tree.n
        return logits

    def step_pass(self, tokens: torch.Tensor, cache: ModelCache) -> torch.Tensor:
        """Attention layers: decode attention, K/V appended; Mamba2 layers: conv shift and one
        recurrence step."""
        root = TreeIndex.root_only(self.device)  # once per step, shared by the attention layers

        def mix(i, layer, x):
            s = self._slot[i]
            if i in self.cfg.attn_layers:
                return layer.self_attn.step(x, cache.k[s], cache.v[s], cache.seqlens, root, self.kernel_backend)
            return layer.mamba.step(x, cache.conv[s], cache.ssm[s], self.kernel_backend)

        return self._run(tokens, mix)

    @torch.no_grad()
    def commit(self, cache: ModelCache, tree: TokenTree, accepted: torch.Tensor, num_accepted: torch.Tensor):
        """SSM layers: activation replay; attention layers: accepted K/V into consecutive slots."""
        self.check_commit(cache, tree, accepted, num_accepted)
        for i, layer in enumerate(self.model.layers):
            s = self._slot[i]
            if i in self.cfg.attn_layers:
                layer.self_attn.commit(cache.scratch[i], cache.k[s], cache.v[s], cache.seqlens, accepted, num_accepted)
            else:
                layer.mamba.replay(cache.scratch[i], cache.conv[s], cache.ssm[s], accepted, num_accepted,
                                   self.kernel_backend)
        self.finish_commit(cache, num_accepted)
