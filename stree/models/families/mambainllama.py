"""MambaInLlama hybrid: Llama pre-norm blocks with a SwiGLU MLP, the token mixer being GQA
attention (RoPE at ``prefix_len + depth``) at ``attn_layers`` and Mamba2 (d_xb variant) elsewhere.
Residual stream in model dtype. HF Llama parameter names (``model.layers.i.self_attn.*``,
``model.layers.i.mamba.*``)."""

from __future__ import annotations

from torch import nn

from ..layers.attention import LlamaAttention
from ..base import Block, TreeLM
from ..config import HybridConfig
from ..layers.mamba2 import Mamba2Mixer
from ..layers.norms import RMSNorm
from ..layers.mlp import SwiGLU


class HybridLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, attention: bool, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype)
        self.mlp = SwiGLU(cfg.d_model, cfg.intermediate_size, device=device, dtype=dtype)
        if attention:
            self.self_attn = LlamaAttention(cfg.d_model, cfg.attention, device, dtype)
        else:
            self.mamba = Mamba2Mixer(cfg.mamba, device, dtype)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if hasattr(self, "self_attn") else self.mamba


class HybridBody(nn.Module):
    def __init__(self, cfg: HybridConfig, device=None, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(HybridLayer(cfg, i in cfg.attn_layers, device, dtype) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, device, dtype, round_before_weight=True)


class HybridLM(TreeLM):
    embed_key = "model.embed_tokens.weight"
    final_norm_name = "model.norm"

    def __init__(self, cfg: HybridConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.model = HybridBody(cfg, device, dtype)
        self.make_head(cfg.d_model, cfg.vocab_size, cfg.tie_word_embeddings, device, dtype)
        self.residual_fp32 = False
        self.blocks = [Block(layer.input_layernorm, layer.mixer, layer.post_attention_layernorm, layer.mlp)
                       for layer in self.model.layers]
