import pytest
import torch

from stree.models import HybridConfig, HybridLM, Mamba2Config
from stree.models.base import TreeContext
from stree.models.cache import SSMLayerState
from stree.models.layers.mamba2 import Mamba2Mixer
from stree.tree import TokenTree, TreeShape

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # tiny context so every frequency band occurs


def _cfg(attn_layers=(1,), n_layer=3, rope_scaling=LLAMA3, tie=False):
    return HybridConfig(d_model=32, n_layer=n_layer, vocab_size=90, attn_layers=attn_layers, intermediate_size=48,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, d_inner=32, d_xb=16, d_state=8,
                        ngroups=4, rope_theta=10000.0, rope_scaling=rope_scaling, tie_word_embeddings=tie)


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    model = HybridLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("rope_scaling", [LLAMA3, None])
def test_all_attention_hybrid_equals_transformers_llama(rope_scaling):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _cfg(attn_layers=(0, 1), n_layer=2, rope_scaling=rope_scaling)
    model = _model(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta} if rope_scaling is None else {
        **rope_scaling, "rope_theta": cfg.rope_theta}
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope, tie_word_embeddings=False, max_position_embeddings=64)).eval()
    llama.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, 90, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = llama(ids).logits
    cache = model.allocate_cache(2, 40)
    every, _ = model.forward_tree(TokenTree.from_shape(TreeShape.chain(19), ids[:, :20]), cache)
    assert (every - ref[:, :20]).abs().max() <= 1e-4
    model.prefill(ids[:, :20], cache)
    for t in range(20, 30):  # steps past original_max_position_embeddings
        assert (model.step(ids[:, t], cache) - ref[:, t]).abs().max() <= 1e-4


def test_d_xb_mixer_equals_standard_mamba2_with_tiled_weights():
    """MIL's mixer is a standard Mamba2 mixer whose x and B projection rows (and conv channels)
    are tiled to every head: check the d_xb path against that expansion."""
    mil_cfg = _cfg().mamba
    std_cfg = Mamba2Config(d_model=32, n_layer=1, vocab_size=90, d_state=8, expand=1, headdim=8, ngroups=4)
    torch.manual_seed(0)
    mil, std = Mamba2Mixer(mil_cfg).eval(), Mamba2Mixer(std_cfg).eval()
    rep = mil_cfg.nheads // (mil_cfg.d_xb // mil_cfg.headdim)
    d, dx = mil_cfg.d_inner, mil_cfg.d_xb
    tile = lambda t: t.unflatten(0, (dx // 8, 8)).repeat_interleave(rep, dim=0).flatten(0, 1)
    with torch.no_grad():
        W, cw, cb = mil.in_proj.weight, mil.conv1d.weight, mil.conv1d.bias
        z, x, B, C, dt = W.split([d, dx, dx, d, mil_cfg.nheads])
        std.in_proj.weight.copy_(torch.cat([z, tile(x), tile(B), C, dt]))
        xw, Bw, Cw = cw.split([dx, dx, d])
        std.conv1d.weight.copy_(torch.cat([tile(xw), tile(Bw), Cw]))
        xb, Bb, Cb = cb.split([dx, dx, d])
        std.conv1d.bias.copy_(torch.cat([tile(xb), tile(Bb), Cb]))
        for name in ("dt_bias", "A_log", "D"):
            getattr(std, name).copy_(getattr(mil, name))
        std.norm.weight.copy_(mil.norm.weight)
        std.out_proj.weight.copy_(mil.out_proj.weight)
    shape = TreeShape.paper13()
    u = torch.randn(2, shape.n, 32)
    index = TokenTree.from_shape(shape, torch.zeros(2, shape.n, dtype=torch.long)).index
    conv = torch.randn(2, mil_cfg.conv_dim, 4)
    conv_std = torch.cat([tile(conv[:, :dx].transpose(0, 1)).transpose(0, 1),
                          tile(conv[:, dx:2 * dx].transpose(0, 1)).transpose(0, 1), conv[:, 2 * dx:]], dim=1)
    ssm = torch.randn(2, 4, 8, 8)
    ctx = TreeContext(index, None, None, "tree", "auto")
    out_mil, _ = mil.tree(u, ctx, SSMLayerState(conv, ssm))
    out_std, _ = std.tree(u, ctx, SSMLayerState(conv_std, ssm))
    assert (out_mil - out_std).abs().max() <= 1e-5


def test_config_errors():
    with pytest.raises(ValueError, match=r"attn_layers \[5\] outside \[0, n_layer = 3\)"):
        _cfg(attn_layers=(5,))
    with pytest.raises(ValueError, match="rope_type must be one of"):
        HybridLM(_cfg(rope_scaling={"rope_type": "yarn"}))
