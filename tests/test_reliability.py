"""Bad input ends in a named error before anything large is built: non-finite weights and logits,
trees past the kernels' limit, broken configs, devices that do not exist."""

import json
import shutil
import time

import pytest
import torch
from tiny_models import mamba2

from stree.tools.cli import main
from stree.tools.demo import TARGET
from stree.decoding.loop import generate
from stree.models import load, save
from stree.tree import MAX_TREE_NODES, TokenTree, TreeShape, tree_index


@pytest.fixture(scope="module")
def model():
    return load(TARGET, dtype=torch.float32)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8), dict(method="autoregressive"),
                                dict(method="autoregressive", temperature=1.0), dict(method="chain")])
def test_non_finite_logits_stop_generate_with_the_step_named(model, kw):
    """A weight turned NaN that only a later token reads: the prefill is fine, the step that first
    feeds the token raises (no crash inside sampling, no EOS or '!!!!' returned)."""
    prompt = [5, 6, 7]
    ref = generate(model, [prompt], max_new_tokens=8, **kw, seed=0)
    token = next(t for t in ref.new_tokens[0] if t not in prompt)
    broken = load(TARGET, dtype=torch.float32)
    broken.lm_head.weight = torch.nn.Parameter(broken.lm_head.weight.clone())  # untied: the head stays finite
    with torch.no_grad():
        broken.backbone.embedding.weight[token, 0] = float("nan")
    with pytest.raises(ValueError, match=r"logits hold NaN or \+inf at decoding step \d+ \(rows \[0\]\)"):
        generate(broken, [prompt], max_new_tokens=8, **kw, seed=0)
    with torch.no_grad():
        broken.backbone.embedding.weight[prompt[0], 0] = float("inf")
    with pytest.raises(ValueError, match=r"logits hold NaN or \+inf at the prefill"):
        generate(broken, [prompt], max_new_tokens=8, **kw, seed=0)


def test_load_names_a_non_finite_tensor(tmp_path):
    m = mamba2()
    with torch.no_grad():
        m.backbone.layers[1].mixer.in_proj.weight[0, :3] = float("nan")
    save(m, tmp_path)
    with pytest.raises(ValueError, match=r"'backbone.layers.1.mixer.in_proj.weight' holds 3 NaN or inf values"):
        load(tmp_path)
    assert load(tmp_path, check_finite=False).backbone.layers[1].mixer.in_proj.weight.isnan().sum() == 3


@pytest.mark.parametrize("make", [lambda: TreeShape.from_spec("full:4x8"), lambda: TreeShape.full(1000, 1000),
                                  lambda: TreeShape.chain(MAX_TREE_NODES), lambda: TreeShape.from_children([2000]),
                                  lambda: tree_index(torch.arange(-1, 5000)),
                                  lambda: TokenTree(torch.arange(-1, 5000), torch.zeros(1, 5001, dtype=torch.long)).index])
def test_trees_past_the_kernels_limit_are_refused_before_anything_n_by_n(make):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"(more than the|larger than the) {MAX_TREE_NODES} nodes"):
        make()
    assert time.perf_counter() - start < 1.0  # no 87,381^2 mask was built first
    assert TreeShape.chain(MAX_TREE_NODES - 1).n == MAX_TREE_NODES


def test_cli_refuses_a_huge_tree_in_one_line(capsys):
    assert main(["generate", "--model", str(TARGET), "--prompt", "x", "--tree", "full:4x8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "full:4x8" in err and "1024 nodes" in err


@pytest.mark.parametrize("edit,message", [
    (dict(pad_vocab_size_multiple=0), "pad_vocab_size_multiple must be a positive integer, got 0"),
    (dict(ssm_cfg={"layer": "Mamba2", "dt_limit": "abc"}), "ssm_cfg.dt_limit must be a pair of numbers, got 'abc'"),
    (dict(ssm_cfg={"layer": "Mamba2", "chunk_size": -4}), "chunk_size must be a positive integer, got -4"),
    (dict(ssm_cfg={"layer": "Mamba2", "conv_bias": "yes"}), "conv_bias must be true or false, got 'yes'"),
    (dict(tie_embeddings=1), "tie_embeddings must be true or false, got 1"),
    (dict(ssm_cfg={"layer": "Mamba2", "dt_limit": [0.5, 0.1]}), r"dt_limit must satisfy 0 <= min <= max"),
])
def test_broken_configs_name_the_file_and_the_key(tmp_path, edit, message):
    save(mamba2(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update({k: ({**config["ssm_cfg"], **v} if k == "ssm_cfg" else v) for k, v in edit.items()})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as info:
        load(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_a_file_and_a_missing_device_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="is a file: give the checkpoint directory"):
        load(TARGET / "config.json")
    with pytest.raises(ValueError, match="device 'tpu:9' is not a device"):
        load(TARGET, device="tpu:9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:1': CUDA is not available here"):
            load(TARGET, device="cuda:1")
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype, got torch.int64"):
        load(TARGET, dtype=torch.int64)
    for argv in (["--device", "npu"], ["--prompt", "bad \udcff bytes"]):
        assert main(["generate", "--model", str(TARGET), "--prompt", "x", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("stree generate: error:")


def test_config_is_read_before_the_weights(tmp_path, monkeypatch):
    """A broken config fails without reading a byte of the weights."""
    shutil.copytree(TARGET, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "n_layer": 0}))
    from stree.checkpoints import io

    monkeypatch.setattr(io, "read_weights", lambda path: pytest.fail("weights read before the config check"))
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        load(tmp_path / "m")


def test_one_seed_gives_the_drafter_and_the_verifier_independent_streams(model):
    """generate(seed=s) reseeds the drafter from s, apart from the verifier's stream (before, both
    were torch generators seeded 0 by default: the same numbers): drafters built with different
    seeds of their own give the same output under one generate seed."""
    from stree.drafters import STANDDrafter, STANDStore

    seeds = []

    class Recording(STANDDrafter):
        def reseed(self, seed):
            seeds.append(seed)
            super().reseed(seed)

    kw = dict(max_new_tokens=24, temperature=0.9, seed=0)
    a = generate(model, [[5, 6, 7]], drafter=Recording(STANDStore(), seed=0), **kw)
    b = generate(model, [[5, 6, 7]], drafter=Recording(STANDStore(), seed=123), **kw)
    assert a.sequences == b.sequences and seeds[0] == seeds[1] != 0
    c = generate(model, [[5, 6, 7]], drafter=Recording(STANDStore(), seed=0), **{**kw, "seed": 1})
    assert seeds[2] != seeds[0] and c.sequences != a.sequences
    draws = torch.rand(8, generator=torch.Generator().manual_seed(seeds[0]))
    assert not torch.equal(draws, torch.rand(8, generator=torch.Generator().manual_seed(0)))
