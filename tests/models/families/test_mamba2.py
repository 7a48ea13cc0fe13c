import pytest
import torch

from stree.models import Mamba2Config, Mamba2LM
from stree.tree import TokenTree, TreeShape


def _model(ngroups=1, n_layer=2, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = Mamba2Config(d_model=32, n_layer=n_layer, vocab_size=100, d_state=8, headdim=8, ngroups=ngroups,
                       chunk_size=8, **kw)
    model = Mamba2LM(cfg).eval()
    with torch.no_grad():  # random but non-trivial conv biases and norms, so every term matters
        for p in model.parameters():
            if p.dim() == 1 and p.shape[0] not in (cfg.nheads,):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _hf_twin(model):
    from transformers import Mamba2Config as HFConfig
    from transformers import Mamba2ForCausalLM

    cfg = model.cfg
    hf = Mamba2ForCausalLM(HFConfig(
        vocab_size=cfg.padded_vocab_size, hidden_size=cfg.d_model, state_size=cfg.d_state,
        num_hidden_layers=cfg.n_layer, layer_norm_epsilon=cfg.norm_eps, expand=cfg.expand, conv_kernel=cfg.d_conv,
        n_groups=cfg.ngroups, use_bias=cfg.bias, use_conv_bias=cfg.conv_bias, num_heads=cfg.nheads,
        head_dim=cfg.headdim, chunk_size=cfg.chunk_size, tie_word_embeddings=cfg.tie_embeddings,
        residual_in_fp32=cfg.residual_in_fp32)).eval()
    state = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in model.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    return hf


@pytest.mark.parametrize("ngroups, n_layer", [(1, 2), (2, 3)])
def test_matches_transformers_prefill_and_steps(ngroups, n_layer):
    model = _model(ngroups, n_layer)
    hf = _hf_twin(model)
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids, use_cache=True)
    cache = model.allocate_cache(2, 64)
    every, _ = model.forward_tree(TokenTree.from_shape(TreeShape.chain(10), ids), cache)
    assert every.shape == (2, 11, 112)  # vocabulary padded to a multiple of 16
    assert (every - out.logits).abs().max() <= 1e-4
    last = model.prefill(ids, cache)
    assert (last - out.logits[:, -1]).abs().max() <= 1e-4
    hf_cache = out.cache_params
    tok = last.argmax(-1)
    for _ in range(10):
        with torch.no_grad():
            ref = hf(tok[:, None], cache_params=hf_cache, use_cache=True).logits[:, -1]
        got = model.step(tok, cache)
        assert (got - ref).abs().max() <= 1e-4
        tok = ref.argmax(-1)
    assert cache.seqlens.tolist() == [21, 21]


def test_bad_inputs_raise_clear_errors():
    model = _model()
    cache = model.allocate_cache(2, 10)
    with pytest.raises(ValueError, match=r"input_ids\[0, 1\] = 112 is outside the vocabulary \[0, 112\)"):
        model.prefill(torch.tensor([[1, 112], [1, 2]]), cache)
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        model.prefill(torch.zeros(2, 3), cache)
    with pytest.raises(ValueError, match="past the cache's max_length 10"):
        model.prefill(torch.ones(2, 11, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="the cache holds 2 rows but the input has batch 3"):
        model.step(torch.ones(3, dtype=torch.long), cache)
    model.prefill(torch.ones(2, 4, dtype=torch.long), cache, lengths=torch.tensor([4, 2]))
    tree = TokenTree.from_shape(TreeShape.chain(3), torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="tree_pass must be the TreePass forward_tree returned, got TokenTree"):
        model.commit(cache, tree, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    _, tree_pass = model.forward_tree(tree, cache)
    with pytest.raises(ValueError, match=r"accepted\[1, 1\] = 7 is not a node index in \[0, 4\)"):
        model.commit(cache, tree_pass, torch.tensor([[0, 1], [0, 7]]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"num_accepted\[0\] = 0 must be in \[1, 2\]"):
        model.commit(cache, tree_pass, torch.tensor([[0, 1], [0, 1]]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"accepted\[0, 0\] = 1: a path starts at the root"):
        model.commit(cache, tree_pass, torch.tensor([[1, 2], [0, 1]]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"accepted\[1\] is not a root path: node 2 is not a child of node 0"):
        model.commit(cache, tree_pass, torch.tensor([[0, 1], [0, 2]]), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="accepted has 5 columns but the tree is only 4 levels deep"):
        model.commit(cache, tree_pass, torch.zeros(2, 5, dtype=torch.long), torch.ones(2, dtype=torch.long))
    other = model.allocate_cache(2, 10)
    with pytest.raises(ValueError, match="tree_pass was computed on another cache"):
        model.commit(other, tree_pass, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    model.commit(cache, tree_pass, torch.tensor([[0, 1], [0, 0]]), torch.tensor([2, 1]))  # the path may end early
    assert cache.seqlens.tolist() == [6, 3]
    with pytest.raises(ValueError, match="tree_pass is stale"):
        model.commit(cache, tree_pass, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="scan must be one of"):
        model.forward_tree(tree, cache, scan="fast")
    with pytest.raises(ValueError, match=r"lengths must be \[batch\] with 1 <= lengths <= 3"):
        model.prefill(torch.ones(2, 3, dtype=torch.long), cache, lengths=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="Mamba2Config.d_model must be a positive integer"):
        Mamba2Config(d_model=0, n_layer=1, vocab_size=10)


def test_a_derived_constant_follows_a_parameter_replaced_at_the_same_version():
    """A model moved to another device or dtype gets new parameter tensors whose version counters
    restart: a cache keyed by versions alone handed the GPU model its CPU ``A`` stack."""
    from stree.models.base import derived, value_key

    class Owner:
        pass

    owner, old = Owner(), torch.zeros(3)
    new = old.clone()  # the same version, another storage
    assert old._version == new._version and value_key(old) != value_key(new)
    assert derived(owner, "x", lambda: old + 1, key=value_key(old)).sum() == 3
    assert derived(owner, "x", lambda: new + 2, key=value_key(new)).sum() == 6
