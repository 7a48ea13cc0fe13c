import json

import pytest
import torch

from stree.models import HybridConfig, HybridLM, Mamba2Config, Mamba2LM, detect_format, load, load_tokenizer, save
from stree.tree import TokenTree, TreeShape


def _model(tie=True, ngroups=2):
    torch.manual_seed(0)
    return Mamba2LM(Mamba2Config(d_model=32, n_layer=2, vocab_size=100, d_state=8, headdim=8, ngroups=ngroups,
                                 tie_embeddings=tie)).eval()


def _logits(model):
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    return model.forward_tree(TokenTree.from_shape(TreeShape.chain(8), ids), model.allocate_cache(2, 16))[0]


@pytest.mark.parametrize("fmt", ["mamba_ssm", "hf"])
@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip_gives_identical_logits(fmt, tie, tmp_path):
    model = _model(tie)
    save(model, tmp_path, format=fmt)
    assert detect_format(tmp_path) == fmt
    loaded = load(tmp_path)
    assert loaded.cfg.padded_vocab_size == model.cfg.padded_vocab_size
    assert (loaded.lm_head.weight is loaded.backbone.embedding.weight) == tie
    assert torch.equal(_logits(loaded), _logits(model))


def test_hf_directory_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import Mamba2ForCausalLM

    model = _model(ngroups=2)
    save(model, tmp_path, format="hf")
    hf = Mamba2ForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - _logits(model)).abs().max() <= 1e-4


def test_mamba_ssm_bin_with_defaults_and_tied_duplicate(tmp_path):
    """The state-spaces layout: config.json with only ``{"layer": "Mamba2"}`` plus the sizes that
    differ from mamba_ssm's defaults, and a pickled state dict holding lm_head and the embedding."""
    torch.manual_seed(0)
    cfg = Mamba2Config(d_model=64, n_layer=1, vocab_size=50, d_state=128, headdim=64)  # mamba_ssm defaults
    model = Mamba2LM(cfg).eval()
    state = {k: v.half() if k != "backbone.layers.0.mixer.D" else v for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(dict(
        d_model=64, n_layer=1, vocab_size=50, ssm_cfg={"layer": "Mamba2"}, rms_norm=True, residual_in_fp32=True,
        fused_add_norm=True, pad_vocab_size_multiple=16, tie_embeddings=True)))
    loaded = load(tmp_path)
    assert loaded.cfg == cfg
    assert loaded.dtype == torch.float16 and loaded.backbone.layers[0].mixer.D.dtype == torch.float32
    as_bf16 = load(tmp_path, dtype=torch.bfloat16)
    assert as_bf16.backbone.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    assert as_bf16.backbone.layers[0].mixer.D.dtype == torch.float32


def test_malformed_checkpoints_name_the_file_and_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        load(tmp_path)

    save(_model(), tmp_path, format="mamba_ssm")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "ssm_cfg": {**cfg["ssm_cfg"], "d_state": 16}}))
    with pytest.raises(ValueError, match=r"model.safetensors: 'backbone.layers.0.mixer.in_proj.weight' has shape"):
        load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "ssm_cfg": {**cfg["ssm_cfg"], "D_has_hdim": True}}))
    with pytest.raises(ValueError, match="ssm_cfg.D_has_hdim = True is not supported"):
        load(tmp_path)
    del cfg["n_layer"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json: missing key 'n_layer'"):
        load(tmp_path)

    from safetensors.torch import load_file, save_file

    save(_model(), tmp_path, format="hf")
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["backbone.layers.1.mixer.A_log"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors: missing key 'backbone.layers.1.mixer.A_log'"):
        load(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        load(tmp_path)
    with pytest.raises(ValueError, match="format must be one of"):
        save(_model(), tmp_path, format="gguf")
    with pytest.raises(ValueError, match="format 'mil' does not fit a Mamba2LM"):
        save(_model(), tmp_path, format="mil")


def _hybrid(tie=False):
    torch.manual_seed(0)
    return HybridLM(HybridConfig(
        d_model=32, n_layer=3, vocab_size=90, attn_layers=[1], intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, d_inner=32, d_xb=16, d_state=8, ngroups=4, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, tie_word_embeddings=tie)).eval()


def _hybrid_logits(model):
    ids = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(1))
    return model.forward_tree(TokenTree.from_shape(TreeShape.chain(19), ids), model.allocate_cache(2, 24))[0]


@pytest.mark.parametrize("tie", [True, False])
def test_mil_round_trip_gives_identical_logits(tie, tmp_path):
    model = _hybrid(tie)
    save(model, tmp_path)
    assert detect_format(tmp_path) == "mil"
    loaded = load(tmp_path)
    assert loaded.cfg == model.cfg
    assert torch.equal(_hybrid_logits(loaded), _hybrid_logits(model))
    plain = load(tmp_path, plain_rope=True)
    assert plain.cfg.rope_scaling is None
    assert not torch.allclose(_hybrid_logits(plain), _hybrid_logits(model))  # the switch changes positions > 16


def test_mil_bin_without_lm_head_ties_it_and_casts(tmp_path):
    model = _hybrid(tie=False)
    save(model, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = load(tmp_path, dtype=torch.bfloat16)
    assert loaded.cfg.tie_word_embeddings and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert loaded.dtype == torch.bfloat16 and loaded.model.layers[0].mamba.D.dtype == torch.float32


def test_malformed_mil_checkpoints(tmp_path):
    save(_hybrid(), tmp_path)
    mamba = json.loads((tmp_path / "mamba_config.json").read_text())
    (tmp_path / "mamba_config.json").write_text(json.dumps({k: v for k, v in mamba.items() if k != "d_xb"}))
    with pytest.raises(ValueError, match="mamba_config.json: missing key 'd_xb'"):
        load(tmp_path)
    (tmp_path / "mamba_config.json").write_text(json.dumps({**mamba, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        load(tmp_path)
    (tmp_path / "mamba_config.json").write_text(json.dumps({**mamba, "attn_layers": [0]}))
    with pytest.raises(ValueError, match=r"'model.layers.0.mamba.in_proj.weight'|missing key 'model.layers.0.self_attn"):
        load(tmp_path)


def test_load_tokenizer_offline(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    text = "def f(x):\n    return x + 1\n"
    assert loaded.decode(loaded.encode(text)) == text


def test_transformers5_mamba2_with_its_default_config(tmp_path):
    """transformers 5 writes the default time_step_limit as [0.0, {"__float__": "Infinity"}]."""
    from transformers import Mamba2Config as HFConfig, Mamba2ForCausalLM

    torch.manual_seed(0)
    hf = Mamba2ForCausalLM(HFConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                                    state_size=8, n_groups=2, expand=2)).eval()
    hf.save_pretrained(str(tmp_path))
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    model = load(tmp_path)
    assert model.cfg.dt_limit == (0.0, float("inf"))
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() <= 1e-4


def test_infinity_literal_configs_load(tmp_path):
    model = _model()
    save(model, tmp_path, format="hf")
    text = (tmp_path / "config.json").read_text()
    assert "Infinity" in text  # Python's json writes the literal, as transformers 4.x did
    assert load(tmp_path).cfg.dt_limit == (0.0, float("inf"))
    cfg = json.loads(text)
    for bad in ([0.0], "inf", [0.0, {"__float__": "lots"}]):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "time_step_limit": bad}))
        with pytest.raises(ValueError, match="config.json"):
            load(tmp_path)


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_sharded_checkpoints_load_and_name_a_missing_shard(kind, tmp_path):
    from safetensors.torch import save_file

    model = _model(tie=False)
    save(model, tmp_path, format="hf")
    (tmp_path / "model.safetensors").unlink()
    state = {k.replace("backbone.embedding.", "backbone.embeddings.", 1): v.contiguous()
             for k, v in model.state_dict().items()}
    keys = sorted(state)
    shards = {f"model-0000{i + 1}-of-00003.{kind}": keys[i::3] for i in range(3)}
    for name, part in shards.items():
        tensors = {k: state[k] for k in part}
        save_file(tensors, str(tmp_path / name)) if kind == "safetensors" else torch.save(tensors, tmp_path / name)
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / index).write_text(json.dumps({"weight_map": {k: name for name, part in shards.items() for k in part}}))
    assert torch.equal(_logits(load(tmp_path)), _logits(model))
    (tmp_path / f"model-00002-of-00003.{kind}").unlink()
    with pytest.raises(FileNotFoundError, match=rf"model-00002-of-00003.{kind} is missing \(listed in .*{index}\)"):
        load(tmp_path)
    (tmp_path / index).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=rf"{index}: missing or empty 'weight_map'"):
        load(tmp_path)


def test_a_drafters_ranked_tokens_load_with_it_and_a_bad_file_is_named(tmp_path):
    """draft_vocab.json (``stree distill`` writes it): the ids, most frequent first, on the loaded model;
    ids repeated, out of the vocabulary or missing are a ValueError naming the file."""
    from stree.checkpoints.io import write_draft_vocab

    model = _model()
    save(model, tmp_path)
    assert not hasattr(load(tmp_path), "draft_vocab")
    write_draft_vocab(tmp_path, [[5, 7, 7, 3], [7, 3]], "corpus-id")
    assert json.loads((tmp_path / "draft_vocab.json").read_text()) == dict(corpus="corpus-id", ids=[7, 3, 5],
                                                                          counts=[3, 2, 1])
    assert load(tmp_path).draft_vocab.tolist() == [7, 3, 5]
    for bad in ([7, 7], [7, 200], [], "7"):
        (tmp_path / "draft_vocab.json").write_text(json.dumps(dict(ids=bad)))
        with pytest.raises(ValueError, match="draft_vocab.json: 'ids' must be a non-empty list of distinct"):
            load(tmp_path)
