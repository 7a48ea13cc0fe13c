"""Tiny random models of both families, shared by the protocol and end-to-end decoding tests."""

import torch

from stree.models import HybridConfig, HybridLM, Mamba2Config, Mamba2LM

VOCAB = 90


def perturb_norms(model):
    with torch.no_grad():  # non-trivial norm weights, so every term matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("norm_f.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def mamba2(vocab_size=VOCAB, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(d_model=32, n_layer=2, vocab_size=vocab_size, d_state=8, headdim=8, ngroups=2)
    return perturb_norms(Mamba2LM(Mamba2Config(**{**cfg, **kw})).eval())


def hybrid(vocab_size=VOCAB, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(d_model=32, n_layer=3, vocab_size=vocab_size, attn_layers=[1], intermediate_size=48,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, d_inner=32, d_xb=16, d_state=8,
               ngroups=4, rope_theta=10000.0)
    return perturb_norms(HybridLM(HybridConfig(**{**cfg, **kw})).eval())


FAMILIES = {"mamba2": mamba2, "hybrid": hybrid}
