"""Mamba2 language model with mamba_ssm ``MambaLMHeadModel`` semantics: embedding, pre-norm blocks
of the Mamba2 mixer, final norm and tied head. Residual stream in fp32 (``residual_in_fp32``),
fused add+norm semantics (the fp32 sum is normalised and multiplied by the weight in fp32,
rounded once)."""

from __future__ import annotations

from torch import nn

from ..base import Block, TreeLM
from ..fused_step import fused_draft, fused_prefill, fused_step, fused_tree, fused_tree_greedy
from ..config import Mamba2Config
from ..layers.mamba2 import Mamba2Mixer
from ..layers.norms import RMSNorm


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
    """Parameter names are mamba_ssm's (``backbone.embedding``, ``backbone.layers.i.mixer.*``).
    The fused add+norm blocks are pre-norm residual blocks with the stream kept in fp32."""

    embed_key = "backbone.embedding.weight"
    final_norm_name = "backbone.norm_f"

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.backbone = Mamba2Backbone(cfg, device, dtype)
        self.make_head(cfg.d_model, cfg.padded_vocab_size, cfg.tie_embeddings, device, dtype)
        self.residual_fp32 = cfg.residual_in_fp32
        self.blocks = [Block(layer.norm, layer.mixer) for layer in self.backbone.layers]

    def fused_step(self, cache, tokens, kernel_backend):
        return fused_step(self, cache, tokens, kernel_backend)

    def fused_prefill(self, cache, tokens, counts, kernel_backend):
        return fused_prefill(self, cache, tokens, counts, kernel_backend)

    def fused_tree(self, cache, tokens, index, kernel_backend):
        return fused_tree(self, cache, tokens, index, kernel_backend)

    def fused_tree_greedy(self, cache, tree, index, max_depth, kernel_backend, top_k=None, step=None):
        return fused_tree_greedy(self, cache, tree, index, max_depth, kernel_backend, top_k, step)

    def fused_draft(self, cache, tokens, counts, parents, nodes, head_ids, restore, before, kernel_backend):
        return fused_draft(self, cache, tokens, counts, parents, nodes, head_ids, restore, before, kernel_backend)
