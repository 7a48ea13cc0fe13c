"""Tensor parallelism on 2 CPU ranks (gloo), spawned by the tests: every family's prefill, step,
tree pass and commit against the single-process model; greedy decoding token-identical with every
kind of tree; the sampling law by chi-square with the ranks seeded apart (rank 0 decides); each
rank reading only its slices; bad world sizes refused before any weight is read; torchrun."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_families import save_tiny
from tiny_models import hybrid, mamba2
from stree.drafters import NGramDrafter, STANDDrafter, STANDStore
from stree.decoding.loop import generate
from stree.models import load, save
from stree.checkpoints.weights import SlicedWeights
from stree.models.parallel import TensorParallel, plan
from stree.testing import MarkovDrafter, cell_counts, chi_square, two_token_law
from stree.testing.ranks import run_ranks
from stree.tree import TokenTree, TreeBudget, TreeShape

TOL = 1e-5
SEEDED_P = 1e-3
ROOT = Path(__file__).resolve().parents[1]

CHECKPOINTS = {
    "mamba2": lambda path: save(mamba2(), path),
    "mamba2 one group": lambda path: save(mamba2(ngroups=1), path),  # B, C whole on every rank
    "mil": lambda path: save(hybrid(), path),
    "bamba": lambda path: save_tiny("bamba", path),
    "nemotron_h moe latent": lambda path: save_tiny(
        "nemotron_h", path, hybrid_override_pattern="MEM*E", n_routed_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, moe_latent_size=16, mlp_bias=True),
    "granite": lambda path: save_tiny("granitemoehybrid", path),
    "falcon_h1 biased": lambda path: save_tiny("falcon_h1", path, mamba_rms_norm=True, mamba_norm_before_gate=True,
                                               projectors_bias=True, attention_bias=True, mamba_n_groups=1),
    "llama": lambda path: save_tiny("llama", path),
    # the other weight layouts: transformers' Mamba2 names, a sharded index, a pickle
    "mamba2 hf": lambda path: save(mamba2(), path, format="hf"),
    "bamba sharded": lambda path: _reshard(save_tiny("bamba", path), path),
    "mil bin": lambda path: _to_bin(save(hybrid(), path), path),
}


def _reshard(_, path):
    """The checkpoint's one safetensors file as two shards and their index."""
    from safetensors.torch import load_file, save_file

    state = load_file(f"{path}/model.safetensors")
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, f"{path}/{name}")
    weight_map = {k: name for name, part in halves.items() for k in part}
    Path(path, "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    os.remove(f"{path}/model.safetensors")


def _to_bin(_, path):
    from safetensors.torch import load_file

    torch.save(load_file(f"{path}/model.safetensors"), f"{path}/pytorch_model.bin")
    os.remove(f"{path}/model.safetensors")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    paths = {}
    for name, make in CHECKPOINTS.items():
        paths[name] = str(root / name.replace(" ", "-"))
        make(paths[name])
    return paths


def protocol(model) -> list[torch.Tensor]:
    """Logits of a ragged two-row prefill, a step, a 13-node tree pass, its commit, a step."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (2, 7), generator=g)
    cache = model.allocate_cache(2, 40)
    out = [model.prefill(ids, cache, lengths=torch.tensor([7, 4]))]
    out.append(model.step(torch.randint(0, model.vocab_size, (2,), generator=g), cache))
    tree = TokenTree.from_shape(TreeShape.paper13(), torch.randint(0, model.vocab_size, (2, 13), generator=g))
    logits, tree_pass = model.forward_tree(tree, cache)
    out.append(logits)
    model.commit(cache, tree_pass, torch.tensor([[0, 2, 6, 0, 0], [0, 1, 4, 7, 11]]), torch.tensor([3, 5]))
    out.append(model.step(torch.randint(0, model.vocab_size, (2,), generator=g), cache))
    return out


def _protocol_ranks(tp, paths: dict) -> dict:
    read = {"n": 0}
    real_read = SlicedWeights.read

    def counting(self, key, idx):
        t = real_read(self, key, idx)
        read["n"] += t.numel()
        return t

    SlicedWeights.read = counting
    results = {}
    for name, path in paths.items():
        read["n"] = 0
        model = load(path, tensor_parallel=tp)
        cache = model.allocate_cache(1, 4)
        results[name] = dict(logits=protocol(model), read=read["n"],
                             local=sum(t.numel() for t in model.state_dict().values()),
                             ssm=None if cache.ssm is None else tuple(cache.ssm.shape),
                             kv=None if cache.k is None else tuple(cache.k.shape))
    return results


def test_every_family_computes_the_single_process_logits_from_its_slices(checkpoints):
    ranks = run_ranks(_protocol_ranks, 2, checkpoints)
    for name, path in checkpoints.items():
        full = load(path)
        want = protocol(full)
        cache = full.allocate_cache(1, 4)
        total = sum(t.numel() for t in full.state_dict().values())
        for rank, got in enumerate(ranks):
            got = got[name]
            for a, b in zip(got["logits"], want):
                assert a.shape == b.shape and (a - b).abs().max() < TOL, (name, rank, (a - b).abs().max())
            assert got["read"] <= got["local"] < 0.7 * total, (name, got["read"], got["local"], total)
            if cache.ssm is not None:  # no rank holds a whole Mamba state: half the heads each
                assert got["ssm"][2] * 2 == cache.ssm.shape[2], name
            if cache.k is not None:
                assert got["kv"][3] * 2 == cache.k.shape[3], name
        assert max(b.abs().max() for b in want) > 1, name  # not a comparison of near-zero logits


CONFIGS = {
    "ngram paper13": dict(drafter=lambda: NGramDrafter(), tree=TreeShape.paper13()),
    "stand-det grown": dict(drafter=lambda: STANDDrafter(STANDStore(), stochastic=False), tree=TreeBudget(20, depth=4)),
    "ngram chain": dict(drafter=lambda: NGramDrafter(), method="chain"),
    "autoregressive": dict(method="autoregressive"),
}
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9], [40, 41, 42, 43, 40, 41]]


def _greedy(model, config: dict, wrap=lambda drafter: drafter):
    kw = dict(config)
    if "drafter" in kw:
        kw["drafter"] = wrap(kw["drafter"]())
    return generate(model, PROMPTS, max_new_tokens=[24, 9, 16], eos_token_id=2, **kw).sequences


def _greedy_ranks(tp, paths: list[str]) -> dict:
    # only rank 0's drafter is used: the others get one that would fail
    wrap = (lambda drafter: drafter) if tp.rank == 0 else _Refusing
    return {(path, name): _greedy(model, config, wrap)
            for path in paths for model in [load(path, tensor_parallel=tp)] for name, config in CONFIGS.items()}


class _Refusing:
    """A drafter that fails if asked to draft (the drafter of a rank that is not rank 0)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name in ("propose", "observe"):
            raise AssertionError(f"a rank other than 0 called {name}")
        return getattr(self.inner, name)


def test_greedy_decoding_is_token_identical_to_one_process(checkpoints):
    paths = [checkpoints["mamba2 one group"], checkpoints["bamba"]]
    ranks = run_ranks(_greedy_ranks, 2, paths)
    for path in paths:
        full = load(path)
        for name, config in CONFIGS.items():
            want = _greedy(full, config)
            assert ranks[0][path, name] == want and ranks[1][path, name] == want, (path, name)


def _sampling_ranks(tp, path: str, q: torch.Tensor) -> tuple:
    model = load(path, tensor_parallel=tp)
    out = generate(model, [[1, 4, 2, 5, 3]] * 3000, drafter=MarkovDrafter(q, seed=4), tree=TreeShape.paper13(),
                   max_new_tokens=2, temperature=0.9, top_p=0.95, seed=5 + 1000 * tp.rank)  # seeded apart
    return out.new_tokens, sum(a[0] for a in out.stats.accepted) / len(out.stats.accepted)


def test_sampling_law_is_the_single_process_law(tmp_path):
    """Temperature 0.9, top-p 0.95, stochastic paper13 drafts, 3000 rows of 2 tokens on 2 ranks
    whose own generators differ: the tokens follow the exact law of the single-process model."""
    model = mamba2(vocab_size=6, pad_vocab_size_multiple=1, seed=2)
    with torch.no_grad():  # flatter logits: a tiny random model is otherwise near-deterministic
        model.backbone.norm_f.weight.mul_(0.1)
    save(model, tmp_path)
    p1, p2 = two_token_law(model, [1, 4, 2, 5, 3], temperature=0.9, top_p=0.95)
    torch.manual_seed(0)
    q = 0.7 * p2.float() + 0.3 * torch.distributions.Dirichlet(torch.ones(6)).sample((6,))
    (tokens, accepted), (tokens1, _) = run_ranks(_sampling_ranks, 2, str(tmp_path), q)
    assert tokens == tokens1  # the ranks emit rank 0's tokens
    assert accepted > 0.5  # the drafts were verified, not just resampled
    _, _, pvalue = chi_square(cell_counts(torch.tensor(tokens), 6), p1[:, None] * p2)
    assert pvalue > SEEDED_P, pvalue


FAKE = SimpleNamespace(world=2, rank=0)
BAD = {
    "Mamba2 mixer: nheads = 3": lambda: mamba2(d_model=24, headdim=16, ngroups=1),
    "Mamba2 mixer: ngroups = 3": lambda: mamba2(d_model=24, headdim=8, ngroups=3),
    "attention: num_key_value_heads = 1": lambda: hybrid(num_key_value_heads=1),
    "MLP: intermediate_size = 47": lambda: hybrid(intermediate_size=47),
}


@pytest.mark.parametrize("message", sorted(BAD))
def test_a_count_the_world_size_does_not_divide_is_named_before_any_weight_is_read(tmp_path, monkeypatch, message):
    model = BAD[message]()
    save(model, tmp_path)
    with pytest.raises(ValueError, match=f"{message} is not divisible by the tensor-parallel world size 2"):
        plan(type(model)(model.cfg, device="meta"), FAKE)
    monkeypatch.setattr(SlicedWeights, "read", lambda *a: pytest.fail("a weight was read"))
    tp = TensorParallel.__new__(TensorParallel)
    tp.world, tp.rank = 2, 0
    with pytest.raises(ValueError, match=message):
        load(tmp_path, tensor_parallel=tp)


def test_bad_tensor_parallel_arguments_are_clear_errors(checkpoints):
    from stree.lm import LM

    model = load(checkpoints["mamba2"])
    with pytest.raises(TypeError, match="tensor_parallel must be a TensorParallel"):
        load(checkpoints["mamba2"], tensor_parallel=2)
    with pytest.raises(ValueError, match="tensor_parallel must be an int >= 1, got 0"):
        LM.from_pretrained(ROOT / "stree/assets/tiny-target", tensor_parallel=0)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        LM.from_pretrained(ROOT / "stree/assets/tiny-target", tensor_parallel=2)
    model.full_vocab, model.tp = model.vocab_size, FAKE  # a slice's decoding refuses what it does not support, before any work
    for kw in (dict(torch_compile=True), dict(method="unrolled")):
        with pytest.raises(ValueError, match="a tensor-parallel model decodes eager"):
            generate(model, [[1, 2, 3]], max_new_tokens=4, **kw)
