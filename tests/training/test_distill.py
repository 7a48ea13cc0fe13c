"""stree distill: a 1-2 layer Mamba2 drafter from a target checkpoint (KL arithmetic, padding
masked, initialisation from the target, learning, loadable output)."""

import json

import pytest
import torch

from stree.tools.cli import main as cli_main
from stree.models import Mamba2LM, load, load_tokenizer
from stree.training import LoopConfig, ModelSize, distill, train_lm
from stree.training.distill import distill_loss, kl_terms
import tiny_models
from test_train_lm import make_corpus

SIZE = ModelSize(d_model=32, n_layer=3, d_state=8, headdim=16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module", params=["mamba2", "hybrid"])
def target(request, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"target-{request.param}")
    loop = LoopConfig(steps=40, batch_size=4, seq_len=24, lr=3e-3, warmup=2, seed=0)
    train_lm(out, corpus=corpus, held_out=("mod0.py",), arch=request.param, vocab_size=300, size=SIZE, loop=loop,
             tokenizer_bytes=None, eval_tokens=200, progress=False)
    return out


def loop(steps):
    return LoopConfig(steps=steps, batch_size=4, seq_len=24, lr=3e-3, warmup=2, seed=0, save_every=10)


def test_kl_terms_match_the_definition():
    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(3, 5, 7, generator=g), torch.randn(3, 5, 9, generator=g)
    kl, same = kl_terms(student, teacher)
    p, q = teacher.double().softmax(-1), student.double().softmax(-1)  # the student's 2 extra ids keep their mass
    expected = (p * (p.log() - q[..., :7].log())).sum(-1)
    torch.testing.assert_close(kl.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(same, student.argmax(-1) == teacher.argmax(-1))
    zero, agree = kl_terms(teacher, teacher)
    assert float(zero.abs().max()) < 1e-6 and bool(agree.all())
    with pytest.raises(ValueError, match="smaller"):
        kl_terms(teacher, student)


def test_padding_is_masked_out_of_the_loss():
    teacher, student = tiny_models.mamba2(seed=0), tiny_models.mamba2(n_layer=1, seed=1)
    ids = torch.randint(1, tiny_models.VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 7:] = False  # row 0's document ended: positions 7.. are padding
    loss = distill_loss(student, teacher, ids, mask)
    with torch.no_grad():
        kl, _ = kl_terms(student(ids[:, :-1]), teacher(ids[:, :-1]))
    real = mask[:, :-1]
    assert loss.item() == pytest.approx(float(kl[real].mean()), rel=1e-5)
    assert loss.item() != pytest.approx(float(kl.mean()), rel=1e-3)


@pytest.mark.parametrize("n_layer", [1, 2])
def test_distill_initialises_from_the_target_learns_and_saves(corpus, target, tmp_path, n_layer):
    report = distill(target, tmp_path, n_layer=n_layer, corpus=corpus, held_out=("mod0.py",), loop=loop(30),
                     eval_tokens=300, progress=False)
    teacher, student = load(target), load(tmp_path)
    assert isinstance(student, Mamba2LM) and student.cfg.n_layer == n_layer
    assert student.cfg.d_model == teacher.cfg.d_model
    assert student.vocab_size >= 300 and load_tokenizer(tmp_path, vocab_size=student.vocab_size)("def")["input_ids"]
    assert report["at_init"]["held_out_kl_nats"] > report["held_out_kl_nats"]
    assert 0 <= report["held_out_top1_agreement"] <= 1
    assert json.loads((tmp_path / "distill.json").read_text())["held_out_kl_nats"] == report["held_out_kl_nats"]
    assert "embedding" in report["initialised_from"]
    # the training split's tokens by count, most frequent first: what a one-call draft's head is cut to
    ranked = json.loads((tmp_path / "draft_vocab.json").read_text())
    assert ranked["corpus"] == report["corpus"] and sorted(ranked["counts"], reverse=True) == ranked["counts"]
    assert student.draft_vocab.tolist() == ranked["ids"] and len(set(ranked["ids"])) == len(ranked["ids"]) > 20


def test_initialisation_copies_the_targets_embeddings(corpus, target, tmp_path):
    report = distill(target, tmp_path, n_layer=2, corpus=corpus, held_out=("mod0.py",),
                     loop=LoopConfig(steps=1, batch_size=1, seq_len=8, lr=1e-9, warmup=0, seed=0), eval_tokens=50,
                     progress=False)
    teacher, student = load(target), load(tmp_path)
    emb = teacher.backbone.embedding.weight if isinstance(teacher, Mamba2LM) else teacher.model.embed_tokens.weight
    torch.testing.assert_close(student.backbone.embedding.weight[:300], emb[:300], atol=1e-6, rtol=0)
    if isinstance(teacher, Mamba2LM):  # layers 0 and n-1 of the target become the drafter's two
        assert report["initialised_from"][2:] == ["layer 0 <- target layer 0", "layer 1 <- target layer 2"]
        torch.testing.assert_close(student.backbone.layers[1].mixer.in_proj.weight,
                                   teacher.backbone.layers[2].mixer.in_proj.weight, atol=1e-6, rtol=0)


def test_cli_distill(corpus, target, tmp_path, capsys):
    args = ["distill", "--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(corpus), "--held-out",
            "mod0.py", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "100"]
    assert cli_main(args) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    assert cli_main(["distill", "--target", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "missing" in capsys.readouterr().err


def test_distill_refuses_a_finished_run_and_a_target_without_a_tokenizer(corpus, target, tmp_path, capsys):
    import shutil

    args = ["distill", "--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(corpus), "--held-out",
            "mod0.py", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "100"]
    assert cli_main(args) == 0
    capsys.readouterr()
    assert cli_main(args) == 2  # the finished drafter stays
    assert "already holds" in capsys.readouterr().err
    assert cli_main(args + ["--steps", "3", "--resume"]) == 0
    bare = tmp_path / "bare"
    bare.mkdir()
    for file in target.iterdir():  # everything but the tokenizer
        if file.is_file() and not file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, bare / file.name)
    assert cli_main(["distill", "--target", str(bare), "--out", str(tmp_path / "e"), "--corpus", str(corpus)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err.splitlines()[-1] and "holds no tokenizer" in err


def test_distill_saves_and_exits_cleanly_on_sigterm(corpus, target, tmp_path, monkeypatch, capsys):
    """stree distill shares the training loop's signal handling: the step finishes, the state is
    saved, one line, exit 143; --resume then completes the run."""
    import importlib
    import os
    import signal

    module = importlib.import_module("stree.training.distill")
    real, calls = module.distill_loss, []

    def signalling(*args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(module, "distill_loss", signalling)
    args = ["distill", "--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(corpus), "--held-out",
            "mod0.py", "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "100"]
    assert cli_main(args) == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("stree distill: interrupted by SIGTERM after step 2") and "--resume" in last
    assert torch.load(tmp_path / "d" / "train_state.pt", weights_only=True)["step"] == 2
    monkeypatch.setattr(module, "distill_loss", real)
    assert cli_main(args + ["--resume"]) == 0
