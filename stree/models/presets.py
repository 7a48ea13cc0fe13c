"""The real model configurations the benchmarks and the ahead-of-time kernel check are sized for.

``layers`` and ``vocab_size`` can be cut: every layer of a kind launches the same kernels at the
same sizes, and the vocabulary only sizes the embedding and the head (plain matmuls).
"""

from __future__ import annotations

import math

from .layers.attention import AttentionConfig
from .families.bamba import BambaConfig, BambaLM
from .config import HybridConfig, Mamba2Config
from .families.mambainllama import HybridLM
from .families.llama import LlamaLM, Qwen2LM, TransformerConfig
from .families.mamba2 import Mamba2LM
from .families.falcon_h1 import FalconH1Config, FalconH1LM
from .families.granite import GraniteConfig, GraniteLM
from .families.nemotron_h import NemotronHConfig, NemotronHLM

__all__ = ["LLAMA3_8B_ROPE", "PRESETS", "TINY", "bamba_9b", "falcon_h1_7b", "granite_4_h_small", "llama_3p1_8b",
           "mamba2_2p7b", "mil_8b", "nemotron_h_8b", "qwen2p5_7b", "tiny_hybrid", "tiny_mamba2"]

LLAMA3_8B_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def mamba2_2p7b(n_layer: int = 64, vocab_size: int = 50277) -> Mamba2Config:
    """state-spaces/mamba2-2.7b: 80 heads of 64 channels, d_state 128, one group."""
    return Mamba2Config(d_model=2560, n_layer=n_layer, vocab_size=vocab_size, pad_vocab_size_multiple=16)


def mil_8b(n_layer: int = 32, vocab_size: int = 128256) -> HybridConfig:
    """MambaInLlama 50% on Llama-3.1-8B (FORMATS.md): attention at every odd layer."""
    return HybridConfig(
        d_model=4096, n_layer=n_layer, vocab_size=vocab_size, attn_layers=list(range(1, n_layer, 2)),
        intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128, d_inner=4096,
        d_xb=1024, d_state=128, ngroups=32, rope_theta=500000.0, rope_scaling=LLAMA3_8B_ROPE)


def bamba_9b(n_layer: int = 32, vocab_size: int = 128256) -> BambaConfig:
    """ibm-ai-platform/Bamba-9B (FORMATS.md section 5): attention at layers 9, 18, 27 (here: every
    ninth from 9, or layer 1 of a cut model), 32 / 8 heads of 128 with RoPE on half of each,
    Mamba2 128 heads x 64, one group, d_state 128."""
    attn = [i for i in (9, 18, 27) if i < n_layer] or [min(1, n_layer - 1)]
    mamba = Mamba2Config(d_model=4096, n_layer=n_layer, vocab_size=vocab_size, headdim=64, ngroups=1,
                         pad_vocab_size_multiple=1, tie_embeddings=False, residual_in_fp32=False,
                         norm_round_before_weight=True)
    return BambaConfig(4096, n_layer, vocab_size, attn, 14336, AttentionConfig(32, 8, 128, rotary_dim=64), mamba)


NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def nemotron_h_8b(n_layer: int = 52, vocab_size: int = 131072) -> NemotronHConfig:
    """nvidia/Nemotron-H-8B-Base-8K: 52 single-op layers (24 Mamba2, 4 attention, 24 squared-ReLU
    MLP; a cut model keeps one of each kind first), hidden 4096, MLP 21504, attention 32 / 8
    heads of 128 without RoPE, Mamba2 128 heads x 64 in 8 groups, d_state 128."""
    pattern = NEMOTRON_H_8B_PATTERN if n_layer == 52 else ("M*-" * n_layer)[:n_layer]
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    mamba = Mamba2Config(d_model=4096, n_layer=n_layer, vocab_size=vocab_size, headdim=64, ngroups=8,
                         dt_limit=(0.001, math.inf), pad_vocab_size_multiple=1, tie_embeddings=False,
                         residual_in_fp32=False, norm_round_before_weight=True, dt_limit_prefill_only=True)
    return NemotronHConfig(4096, vocab_size, tuple(kinds[c] for c in pattern), 21504,
                           AttentionConfig(32, 8, 128, rotary_dim=0), mamba)


def granite_4_h_small(n_layer: int = 40, vocab_size: int = 100352) -> GraniteConfig:
    """ibm-granite/granite-4.0-h-small (32B, 9B active): 40 layers with NoPE attention at 5, 15,
    25, 35 (a cut model: layer 1), 72 experts of intermediate 768 with 10 per token beside the
    shared MLP (published). Hidden 4096, attention 32 / 8 heads of 128, Mamba2 128 heads x 64 in
    one group with d_state 128, shared MLP 8192 are assumed (Bamba-9B's sizes; not checked
    against the checkpoint's config). The µP scalars cost nothing to time and stay at 1."""
    attn = [i for i in (5, 15, 25, 35) if i < n_layer] or [min(1, n_layer - 1)]
    mamba = Mamba2Config(d_model=4096, n_layer=n_layer, vocab_size=vocab_size, headdim=64, ngroups=1,
                         pad_vocab_size_multiple=1, tie_embeddings=False, residual_in_fp32=False, norm_eps=1e-6,
                         norm_round_before_weight=True, dt_limit_prefill_only=True)
    kinds = tuple("attention" if i in attn else "mamba" for i in range(n_layer))
    return GraniteConfig(4096, vocab_size, kinds, 8192, AttentionConfig(32, 8, 128, rotary_dim=0,
                                                                         softmax_scale=1 / 128), mamba,
                         num_experts=72, experts_per_token=10, expert_intermediate_size=768)


def falcon_h1_7b(n_layer: int = 44, vocab_size: int = 130049) -> FalconH1Config:
    """tiiuae/Falcon-H1-7B (transformers' FalconH1 table): 44 layers of parallel attention and
    Mamba2, hidden 3072, attention 12 / 2 heads of 128, Mamba2 24 heads of 128 (d_ssm 3072) with
    d_state 256; the MLP width 12288, one group and the ~130k vocabulary are assumed."""
    mamba = Mamba2Config(d_model=3072, n_layer=n_layer, vocab_size=vocab_size, d_state=256, headdim=128, ngroups=1,
                         chunk_size=128, pad_vocab_size_multiple=1, tie_embeddings=False, residual_in_fp32=False,
                         d_ssm=3072, dt_limit_prefill_only=True, gate_norm="none")
    return FalconH1Config(3072, n_layer, vocab_size, 12288, AttentionConfig(12, 2, 128, rope_theta=1e11), mamba)


def llama_3p1_8b(n_layer: int = 32, vocab_size: int = 128256) -> TransformerConfig:
    """meta-llama/Llama-3.1-8B: hidden 4096, MLP 14336, 32 / 8 heads of 128, Llama 3 RoPE scaling."""
    return TransformerConfig("llama", 4096, n_layer, vocab_size, 14336,
                             AttentionConfig(32, 8, 128, rope_theta=500000.0, rope_scaling=LLAMA3_8B_ROPE), 1e-5)


def qwen2p5_7b(n_layer: int = 28, vocab_size: int = 152064) -> TransformerConfig:
    """Qwen/Qwen2.5-7B: hidden 3584, MLP 18944, 28 / 4 heads of 128 with q/k/v biases, theta 1e6."""
    return TransformerConfig("qwen2", 3584, n_layer, vocab_size, 18944,
                             AttentionConfig(28, 4, 128, rope_theta=1e6, qkv_bias=True), 1e-6)


PRESETS = {"mamba2-2.7b": (Mamba2LM, mamba2_2p7b), "mil-8b": (HybridLM, mil_8b), "bamba-9b": (BambaLM, bamba_9b),
           "nemotron-h-8b": (NemotronHLM, nemotron_h_8b), "granite-4.0-h-small": (GraniteLM, granite_4_h_small),
           "falcon-h1-7b": (FalconH1LM, falcon_h1_7b), "llama-3.1-8b": (LlamaLM, llama_3p1_8b),
           "qwen2.5-7b": (Qwen2LM, qwen2p5_7b)}


def tiny_mamba2(**overrides) -> Mamba2Config:
    """The test suite's Mamba2: every size below a GPU tile (d_state 8, headdim 8, two groups)."""
    return Mamba2Config(**{**dict(d_model=32, n_layer=2, vocab_size=90, d_state=8, headdim=8, ngroups=2), **overrides})


def tiny_hybrid(**overrides) -> HybridConfig:
    """The test suite's MambaInLlama: attention at layer 1 of 3, GQA 4/2 heads of 8."""
    return HybridConfig(**{**dict(d_model=32, n_layer=3, vocab_size=90, attn_layers=[1], intermediate_size=48,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, d_inner=32, d_xb=16,
                                  d_state=8, ngroups=4, rope_theta=10000.0), **overrides})


TINY = {"mamba2-tiny": (Mamba2LM, tiny_mamba2), "mil-tiny": (HybridLM, tiny_hybrid)}
