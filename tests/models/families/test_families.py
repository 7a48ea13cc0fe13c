"""The transformers families (hybrids Bamba, Nemotron-H, Granite 4.0-H, Falcon-H1, attention-only
Llama and Qwen2) against transformers' own classes on tiny
random checkpoints that transformers saved: loading, prefill and steps, tree passes against every
root path fed to transformers, commit then continue, greedy decoding, round trips, bad configs."""

import json

import pytest
import torch
from hf_families import VOCAB, reference_greedy, reference_logits, save_tiny

from stree.drafters import NGramDrafter
from stree.decoding.loop import generate
from stree.models import (
    BambaLM,
    FalconH1LM,
    GraniteLM,
    LlamaLM,
    NemotronHLM,
    Qwen2LM,
    load,
    save,
)
from stree.tree import TokenTree, TreeShape

FAMILIES = {"bamba": BambaLM, "nemotron_h": NemotronHLM, "granitemoehybrid": GraniteLM, "falcon_h1": FalconH1LM,
            "llama": LlamaLM, "qwen2": Qwen2LM}
TOL = 2e-4  # fp32; logits are O(1) with these weights


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    return request.param, hf, load(path), path


def _prompt(seed, n=7):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_load_picks_the_family_from_model_type(pair):
    family, hf, model, _ = pair
    assert type(model) is FAMILIES[family]
    assert model.kinds() == {"bamba": ["ssm", "attn", "ssm", "ssm"], "nemotron_h": ["ssm", "attn", "ssm", "mlp", "ssm"],
                             "granitemoehybrid": ["ssm", "attn", "ssm", "ssm"], "falcon_h1": ["ssm", "attn"] * 3,
                             "llama": ["attn", "attn"], "qwen2": ["attn", "attn"]}[family]


def test_prefill_and_steps_equal_transformers(pair):
    _, hf, model, _ = pair
    prompt, cont = _prompt(1), _prompt(2, 6)
    ref = reference_logits(hf, prompt, cont)
    cache = model.allocate_cache(1, 32)
    ours = [model.prefill(torch.tensor([prompt]), cache)[0]]
    ours += [model.step(torch.tensor([t]), cache)[0] for t in cont]
    assert ref.abs().max() > 1  # the comparison is not between near-zero logits
    assert (torch.stack(ours) - ref).abs().max() < TOL


VARIANTS = {
    "falcon_h1 norm after gate": ("falcon_h1", dict(mamba_rms_norm=True, mamba_norm_before_gate=False)),
    "falcon_h1 norm before gate": ("falcon_h1", dict(mamba_rms_norm=True, mamba_norm_before_gate=True,
                                                     projectors_bias=True, attention_bias=True)),
    "granite rope dense": ("granitemoehybrid", dict(position_embedding_type="rope", num_local_experts=0)),
    "nemotron_h moe": ("nemotron_h", dict(hybrid_override_pattern="ME*E-M", n_routed_experts=8, num_experts_per_tok=3,
                                          moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                                          n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "nemotron_h moe latent": ("nemotron_h", dict(hybrid_override_pattern="MEM*E", n_routed_experts=6,
                                                 num_experts_per_tok=2, moe_intermediate_size=16,
                                                 moe_shared_expert_intermediate_size=24, moe_latent_size=16,
                                                 norm_topk_prob=False)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_family_variants_equal_transformers(tmp_path, variant):
    """The options the fixtures leave at one setting: Falcon-H1's normed Mamba2 gate (either
    order) with biased projections, Granite's RoPE attention without experts."""
    family, overrides = VARIANTS[variant]
    hf = save_tiny(family, tmp_path, **overrides)
    model = load(tmp_path)
    prompt, cont = _prompt(70), _prompt(71, 5)
    ref = reference_logits(hf, prompt, cont)
    cache = model.allocate_cache(1, 32)
    ours = [model.prefill(torch.tensor([prompt]), cache)[0]] + [model.step(torch.tensor([t]), cache)[0] for t in cont]
    assert (torch.stack(ours) - ref).abs().max() < TOL
    out = generate(model, [prompt * 2], tree=TreeShape.paper13(), max_new_tokens=12)
    assert out.new_tokens == [reference_greedy(hf, prompt * 2, 12)]


def test_nemotron_h_clamps_dt_in_prefill_only(tmp_path):
    """transformers' Nemotron-H clamps dt to its time_step_limit in its chunked scan, not in its step, so
    a sequence fed whole and the same sequence stepped differ; stree decodes as the steps do."""
    hf = save_tiny("nemotron_h", tmp_path)
    model = load(tmp_path)
    prompt, cont = _prompt(3), _prompt(4, 5)
    stepped = reference_logits(hf, prompt, cont)[1:]
    with torch.no_grad():
        whole = hf(torch.tensor([prompt + cont])).logits[0, len(prompt):]
    assert (whole - stepped).abs().max() > 10 * TOL  # the clamp matters for these weights
    cache = model.allocate_cache(1, 32)
    model.prefill(torch.tensor([prompt]), cache)
    tree = TokenTree.from_shape(TreeShape.chain(len(cont) - 1), torch.tensor([cont]))
    logits, _ = model.forward_tree(tree, cache)
    assert (logits[0] - stepped).abs().max() < TOL
    assert (model(torch.tensor([prompt + cont]))[0, len(prompt):] - whole).abs().max() < TOL  # training: whole


@pytest.mark.parametrize("shape", [TreeShape.paper13(), TreeShape.full(2, 3)], ids=["paper13", "binary3"])
def test_tree_logits_equal_each_root_path_fed_to_transformers(pair, shape):
    _, hf, model, _ = pair
    prompt = _prompt(5)
    tokens = torch.randint(3, VOCAB, (1, shape.n), generator=torch.Generator().manual_seed(6))
    cache = model.allocate_cache(1, 64)
    model.prefill(torch.tensor([prompt]), cache)
    logits, _ = model.forward_tree(TokenTree.from_shape(shape, tokens), cache)
    parents = shape.parents
    for node in range(shape.n):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        ref = reference_logits(hf, prompt, tokens[0, path].tolist())[-1]
        assert (logits[0, node] - ref).abs().max() < TOL, node


def test_commit_then_continue_equals_sequential_decoding(pair):
    _, hf, model, _ = pair
    shape = TreeShape.full(2, 3)
    prompt = _prompt(7)
    tokens = torch.randint(3, VOCAB, (1, shape.n), generator=torch.Generator().manual_seed(8))
    cache = model.allocate_cache(1, 64)
    model.prefill(torch.tensor([prompt]), cache)
    _, tree_pass = model.forward_tree(TokenTree.from_shape(shape, tokens), cache)
    path = [0, 2, 5]  # root, its second child, that child's first child
    assert [shape.parents[n] for n in path[1:]] == path[:-1]
    model.commit(cache, tree_pass, torch.tensor([path]), torch.tensor([3]))
    nxt = _prompt(9, 3)
    ours = torch.stack([model.step(torch.tensor([t]), cache)[0] for t in nxt])
    ref = reference_logits(hf, prompt, tokens[0, path].tolist() + nxt)[-3:]
    assert (ours - ref).abs().max() < TOL


def test_greedy_decoding_is_token_identical_to_transformers(pair):
    _, hf, model, _ = pair
    prompts = [_prompt(10 + i, 5 + i) * 2 for i in range(3)]  # repeats: the n-gram drafter finds matches
    refs = [reference_greedy(hf, p, 16) for p in prompts]
    for method, shape in (("autoregressive", None), ("chain", TreeShape.chain(3)), ("stree", TreeShape.paper13())):
        out = generate(model, prompts, method=method, tree=shape, drafter=NGramDrafter(), max_new_tokens=16)
        assert out.new_tokens == refs, method


def test_transformers_generate_agrees_with_the_stepped_reference(pair):
    """The reference above is what transformers' own greedy ``generate`` returns."""
    _, hf, _, _ = pair
    prompt = _prompt(20, 8)
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 8, dtype=torch.long), max_new_tokens=10,
                      do_sample=False, eos_token_id=None)
    assert out[0, 8:].tolist() == reference_greedy(hf, prompt, 10)


def test_save_round_trip_and_transformers_reads_what_stree_saves(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    family, hf, model, _ = pair
    save(model, tmp_path)
    again = load(tmp_path)
    assert again.cfg == model.cfg
    ids = torch.tensor([_prompt(30, 10)])
    assert torch.equal(again(ids), model(ids))
    hf2 = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    assert (reference_logits(hf2, ids[0].tolist(), []) - reference_logits(hf, ids[0].tolist(), [])).abs().max() < 1e-6


def test_sharded_checkpoint_and_bf16(pair, tmp_path):
    _, hf, model, _ = pair
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    sharded = load(tmp_path)
    ids = torch.tensor([_prompt(31, 6)])
    assert torch.equal(sharded(ids), model(ids))
    half = load(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    out = generate(half, [_prompt(32)], max_new_tokens=6)
    ref = generate(half, [_prompt(32)], method="autoregressive", max_new_tokens=6)
    assert out.sequences == ref.sequences


def test_unsupported_configs_are_named(tmp_path):
    hf = save_tiny("nemotron_h", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    write = lambda **kw: (tmp_path / "config.json").write_text(json.dumps({**config, **kw}))
    write(layers_block_type=None, hybrid_override_pattern="M*E-M", n_routed_experts=6, n_group=4)
    with pytest.raises(ValueError, match=r"config.json: n_group 4 must divide 6 experts"):
        load(tmp_path)
    write(layers_block_type=None, hybrid_override_pattern="M*X-M")
    with pytest.raises(ValueError, match=r"unknown layer types \['X'\]"):
        load(tmp_path)
    write(model_type="zamba2")
    with pytest.raises(ValueError, match=r"model_type 'zamba2' is not supported \(supported: 'mamba2', 'bamba'"):
        load(tmp_path)
    write(mlp_hidden_act="gelu")
    with pytest.raises(ValueError, match="mlp_hidden_act 'gelu' is not supported"):
        load(tmp_path)
    write(mamba_num_heads=None)
    del hf


def test_greedy_identity_through_the_triton_kernels(pair, device):
    """The families' kernels forced to Triton (the interpreter here, CUDA on a GPU): partial
    rotary and NoPE attention, grouped Mamba2 of heads x head_dim width, the prefill-only clamp."""
    _, _, model, path = pair
    prompts = [_prompt(40, 5) * 2]
    ref = generate(model, prompts, method="autoregressive", max_new_tokens=6)
    triton = load(path, device=device)  # its own copy: the module-wide one stays on the CPU's backend
    triton.kernel_backend = "triton"
    assert generate(triton, prompts, tree=TreeShape.paper13(), max_new_tokens=6).sequences == ref.sequences


def test_sampling_matches_the_enumerated_law(tmp_path):
    """Nemotron-H at temperature 0.9, top-p 0.95, stochastic paper13 drafts near the target: the
    first 2 generated tokens of 12k rows against the exact law from the model's own prefill and
    step distributions, by chi-square (fixed seeds; p > 1e-3, as in tests/decoding/test_generate.py)."""
    from stree.testing import MarkovDrafter, cell_counts, chi_square, two_token_law
    V = 6
    save_tiny("nemotron_h", tmp_path, seed=3, vocab_size=V, pad_token_id=0, eos_token_id=5, bos_token_id=1)
    model = load(tmp_path)
    with torch.no_grad():  # flatter logits: otherwise the tiny model is near-deterministic
        model.backbone.norm_f.weight.mul_(0.1)
    prompt = [1, 4, 2, 5, 3]
    kw = dict(temperature=0.9, top_p=0.95)
    p1, p2 = two_token_law(model, prompt, **kw)
    joint = p1[:, None] * p2
    assert joint.max() < 0.5  # a law with several likely cells, not one
    torch.manual_seed(0)
    q = 0.7 * p2.float() + 0.3 * torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    out = generate(model, [prompt] * 12_000, drafter=MarkovDrafter(q, seed=4), tree=TreeShape.paper13(),
                   max_new_tokens=2, seed=5, eos_token_id=None, **kw)
    assert torch.tensor([a[0] for a in out.stats.accepted], dtype=torch.float).mean() > 0.5
    _, _, pvalue = chi_square(cell_counts(torch.tensor(out.new_tokens), V), joint)
    assert pvalue > 1e-3, pvalue


def test_from_transformers_shares_the_weights(pair):
    from stree.models import from_transformers

    _, hf, model, _ = pair
    wrapped = from_transformers(hf)
    assert type(wrapped) is type(model) and wrapped.cfg == model.cfg
    ids = torch.tensor([_prompt(50, 9)])
    assert torch.equal(wrapped(ids), model(ids))
    shared = {p.data_ptr() for p in hf.parameters()}
    assert all(p.data_ptr() in shared for p in wrapped.parameters())  # no copy
    before = wrapped(ids)
    with torch.no_grad():
        hf.lm_head.weight.mul_(2)
    try:
        assert torch.allclose(wrapped(ids), 2 * before, atol=1e-5)
    finally:
        with torch.no_grad():
            hf.lm_head.weight.div_(2)


def test_from_transformers_mamba2_and_refusals():
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Mamba2Config,
        Mamba2ForCausalLM,
    )

    from stree.models import from_transformers

    torch.manual_seed(0)
    hf = Mamba2ForCausalLM(Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8,
                                        head_dim=8, state_size=8, n_groups=2)).eval()
    ids = torch.tensor([_prompt(51, 9)])
    with torch.no_grad():
        assert (from_transformers(hf)(ids) - hf(ids).logits).abs().max() < 1e-5
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.config: model_type 'gpt2' is not supported"):
        from_transformers(gpt2)


@pytest.mark.parametrize("drafter", ["stand-det", "consensus"])
def test_stand_and_consensus_serve_transformer_targets(tmp_path, drafter):
    """The drafters of papers 000 and 003, which were built for transformers, on a Llama target:
    greedy output token-identical to transformers', with drafts accepted."""
    from stree.drafters.registry import make_drafter

    hf = save_tiny("llama", tmp_path)
    model = load(tmp_path)
    prompts = [_prompt(60 + i, 4) * 3 for i in range(2)]
    out = generate(model, prompts, drafter=make_drafter(drafter, vocab_size=model.vocab_size),
                   tree=TreeShape.paper13(), max_new_tokens=16)
    assert out.new_tokens == [reference_greedy(hf, p, 16) for p in prompts]
    assert sum(map(sum, out.stats.accepted)) > 0


def test_nemotron_h_experts_round_trip_and_share_transformers_weights(tmp_path):
    """The checkpoints keep one up / down matrix per expert; stree stacks them for the grouped
    matmuls, writes them back per expert (transformers reads it), and wraps transformers' own
    stacked experts without a copy."""
    from transformers import AutoModelForCausalLM

    from stree.models import from_transformers

    family, overrides = VARIANTS["nemotron_h moe"]
    hf = save_tiny(family, tmp_path / "hf", **overrides)
    model = load(tmp_path / "hf")
    save(model, tmp_path / "stree")
    again = load(tmp_path / "stree")
    ids = torch.tensor([_prompt(80, 9)])
    assert again.cfg == model.cfg and torch.equal(again(ids), model(ids))
    hf2 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "stree"), local_files_only=True).eval()
    assert (reference_logits(hf2, ids[0].tolist(), []) - reference_logits(hf, ids[0].tolist(), [])).abs().max() < 1e-6
    wrapped = from_transformers(hf)
    assert torch.equal(wrapped(ids), model(ids))
    shared = {p.data_ptr() for p in hf.parameters()}
    assert all(p.data_ptr() in shared for p in wrapped.parameters())
