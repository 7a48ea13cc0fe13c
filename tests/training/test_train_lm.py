"""stree train-lm on a tiny synthetic corpus: loadable checkpoints, bits per byte arithmetic,
learning, and resumption identical to an uninterrupted run."""

import json
import math
import random

import numpy as np
import pytest
import torch

from stree.tools.cli import main as cli_main
from stree.models import Mamba2LM, HybridLM, load, load_tokenizer
from stree.training import HELD_OUT, LoopConfig, ModelSize, TokenCorpus, find_sources, train_lm
from stree.training.loop import train
from stree.training.train_lm import bits_per_byte, token_bytes

SIZE = ModelSize(d_model=32, n_layer=2, d_state=8, headdim=16)
NAMES = ["alpha", "beta", "gamma", "delta", "value", "items", "total", "count"]


def make_corpus(root, n_files=6, funcs=25, seed=0):
    """Regular Python: a model can learn it in a few dozen steps."""
    rng = random.Random(seed)
    for f in range(n_files):
        lines = []
        for i in range(funcs):
            a, b = rng.sample(NAMES, 2)
            lines += [f"def {a}_{i}({a}, {b}):", f"    total = {a} + {b}", f"    return total * {i % 7}", ""]
        (root / f"mod{f}.py").write_text("\n".join(lines))
    (root / "test").mkdir()
    (root / "test" / "skipped.py").write_text("SKIPPED = 1\n")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def run(corpus, out, steps=4, arch="mamba2", seed=0, **kw):
    loop = LoopConfig(steps=steps, batch_size=4, seq_len=24, lr=3e-3, warmup=2, seed=seed, save_every=2)
    return train_lm(out, corpus=corpus, held_out=("mod0.py",), arch=arch, vocab_size=300, size=SIZE, loop=loop,
                    tokenizer_bytes=None, eval_tokens=400, progress=False, **kw)


def test_sources_split_and_skip_test_dirs(corpus):
    split = find_sources(corpus, ("mod0.py",))
    assert [p.name for p in split.held_out] == ["mod0.py"]
    assert sorted(p.name for p in split.train) == [f"mod{i}.py" for i in range(1, 6)]
    with pytest.raises(ValueError, match="held-out"):
        find_sources(corpus, ("missing.py",))


@pytest.mark.parametrize("arch,cls", [("mamba2", Mamba2LM), ("hybrid", HybridLM)])
def test_checkpoint_loads_with_its_tokenizer(corpus, tmp_path, arch, cls):
    report = run(corpus, tmp_path, arch=arch)
    model = load(tmp_path)
    assert isinstance(model, cls)
    tokenizer = load_tokenizer(tmp_path, vocab_size=model.vocab_size)
    text = "def alpha_3(alpha, beta):\n    return total\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and max(ids) < 300 and tokenizer.eos_token_id == 0
    assert json.loads((tmp_path / "training.json").read_text())["model_bits_per_byte"] == report["model_bits_per_byte"]
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert prompts and all("def " in p for p in prompts)
    assert all(p in (corpus / "mod0.py").read_text() for p in prompts)  # held-out text only
    assert math.isfinite(report["model_bits_per_byte"]) and report["held_out_tokens"] > 100


def test_bits_per_byte_arithmetic(corpus, tmp_path):
    run(corpus, tmp_path)
    model, tokenizer = load(tmp_path), load_tokenizer(tmp_path)
    split = find_sources(corpus, ("mod0.py",))
    train_c, test_c = TokenCorpus.encode(tokenizer, split.train), TokenCorpus.encode(tokenizer, split.held_out)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # uniform over the padded vocabulary: ln V nats per token
    m = bits_per_byte(model, tokenizer, train_c, test_c, seq_len=24, max_tokens=10_000, device="cpu")
    doc = test_c.docs[0]
    predicted = np.concatenate([doc[s + 1:s + 25] for s in range(0, len(doc), 25)])
    n_bytes = sum(len(tokenizer.decode([int(t)]).encode()) for t in predicted)
    assert m["held_out_tokens"] == len(predicted) and m["held_out_bytes"] == n_bytes
    assert m["model_bits_per_byte"] == pytest.approx(len(predicted) * math.log2(model.vocab_size) / n_bytes, rel=1e-6)
    counts = np.bincount(np.concatenate(train_c.docs), minlength=len(tokenizer)) + 1.0
    unigram = -np.log2(counts[predicted] / counts.sum()).sum() / n_bytes
    assert m["unigram_bits_per_byte"] == pytest.approx(unigram, rel=1e-9)
    assert token_bytes(tokenizer, len(tokenizer))[tokenizer.eos_token_id] == 0


def test_training_beats_the_unigram_baseline(corpus, tmp_path):
    report = run(corpus, tmp_path, steps=80)
    assert report["model_bits_per_byte"] < 0.8 * report["unigram_bits_per_byte"], report


def test_same_seed_same_weights_other_seed_differs(corpus, tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run(corpus, tmp_path / name, seed=seed)
    sa, sb, sc = (load(tmp_path / name).state_dict() for name in "abc")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


class Interrupt(Exception):
    pass


def test_resume_continues_bit_identically(corpus, tmp_path):
    """A run stopped after its step-2 save and resumed ends with the uninterrupted run's weights."""
    tokenizer_dir = tmp_path / "full"
    run(corpus, tokenizer_dir, steps=4)
    tokenizer = load_tokenizer(tokenizer_dir)
    data = TokenCorpus.encode(tokenizer, find_sources(corpus, ("mod0.py",)).train)
    loop = LoopConfig(steps=5, batch_size=4, seq_len=16, lr=3e-3, warmup=2, seed=0, save_every=2)

    def fresh():
        torch.manual_seed(0)
        return SIZE.build("mamba2", len(tokenizer))

    def loss_for(model, stop_at=None):
        calls = []

        def loss_fn(ids, mask):
            calls.append(1)
            if stop_at is not None and len(calls) > stop_at:
                raise Interrupt
            logits = model(ids[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        return loss_fn

    whole = fresh()
    losses, _ = train(whole, loss_for(whole), data, loop, tmp_path / "whole", identity={}, resume=False, desc="",
                      progress=False)
    cut = fresh()
    with pytest.raises(Interrupt):
        train(cut, loss_for(cut, stop_at=3), data, loop, tmp_path / "cut", identity={}, resume=False, desc="",
              progress=False)
    resumed = fresh()
    again, _ = train(resumed, loss_for(resumed), data, loop, tmp_path / "cut", identity={}, resume=True, desc="",
                     progress=False)
    assert again == losses
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in whole.state_dict().items())
    with pytest.raises(ValueError, match="different settings"):
        train(fresh(), loss_for(resumed), data, loop, tmp_path / "cut", identity={"other": 1}, resume=True, desc="",
              progress=False)


def test_cli_train_lm_and_resume_errors(corpus, tmp_path, capsys):
    args = ["train-lm", "--out", str(tmp_path / "m"), "--corpus", str(corpus), "--held-out", "mod0.py", "--steps", "2",
            "--batch-size", "2", "--seq-len", "16", "--vocab-size", "280", "--d-model", "32", "--n-layer", "1",
            "--d-state", "8", "--headdim", "16", "--eval-tokens", "200", "--save-every", "1"]
    assert cli_main(args) == 0
    assert "held-out bits/byte: model" in capsys.readouterr().out
    assert load(tmp_path / "m").cfg.n_layer == 1
    assert cli_main(args + ["--resume", "--d-model", "64"]) == 2  # other settings than the saved state
    assert "different settings" in capsys.readouterr().err
    assert cli_main(["train-lm", "--out", str(tmp_path / "none"), "--corpus", str(corpus), "--resume"]) == 2


def test_default_corpus_is_the_stdlib_with_every_held_out_module():
    split = find_sources()
    held = {p.relative_to(split.root).as_posix() for p in split.held_out}
    assert held == set(HELD_OUT) and not held & {p.relative_to(split.root).as_posix() for p in split.train}
    assert len(split.train) > 100 and not any({"test", "site-packages"} & set(p.parts) for p in split.train)


def test_a_finished_run_is_never_overwritten_unless_asked(corpus, tmp_path, capsys):
    out = tmp_path / "m"
    run(corpus, out, steps=2)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"already holds config.json, model.safetensors, train_state.pt: --resume"):
        run(corpus, out, steps=2, seed=1)
    assert (out / "model.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="give one"):
        run(corpus, out, steps=2, resume=True, overwrite=True)
    run(corpus, out, steps=2, seed=1, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != before
    args = ["train-lm", "--out", str(out), "--corpus", str(corpus), "--held-out", "mod0.py", "--steps", "2"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "already holds" in err


def test_resume_extends_steps_accumulates_seconds_and_reads_no_pickles(corpus, tmp_path):
    out = tmp_path / "m"
    run(corpus, out, steps=2)
    first = torch.load(out / "train_state.pt", weights_only=True)["seconds"]  # the first part's, to its last save
    longer = run(corpus, out, steps=4, resume=True)
    state = torch.load(out / "train_state.pt", weights_only=True)
    assert state["step"] == 4 and len(state["losses"]) == 4
    assert first > 0 and state["seconds"] > first and longer["seconds"] >= round(first, 1)
    with pytest.raises(ValueError, match="is at step 4, past --steps 3"):
        run(corpus, out, steps=3, resume=True)
    torch.save({**state, "extra": Interrupt()}, out / "train_state.pt")  # an arbitrary object: never unpickled
    with pytest.raises(ValueError, match="train_state.pt is not a readable training state"):
        run(corpus, out, steps=5, resume=True)
    (out / "train_state.pt").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="not a readable training state"):
        run(corpus, out, steps=5, resume=True)


def test_state_files_are_replaced_whole(corpus, tmp_path, monkeypatch):
    """A save that dies half-way leaves the previous state file intact (and no temporary file)."""
    out = tmp_path / "m"
    run(corpus, out, steps=2)
    before = (out / "train_state.pt").read_bytes()
    real_save = torch.save

    def dying_save(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        run(corpus, out, steps=4, resume=True)
    assert (out / "train_state.pt").read_bytes() == before
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_saves_the_step_and_exits_cleanly(corpus, tmp_path, monkeypatch, capsys, signum):
    """SIGINT / SIGTERM during a step: the step completes, the state is saved there, the CLI says
    where in one line and exits 130 / 143; --resume ends where an uninterrupted run ends."""
    import os
    import signal

    import importlib

    module = importlib.import_module("stree.training.train_lm")

    sig = getattr(signal, signum)
    real = module.lm_loss

    def signalling_loss(model, device):
        inner, calls = real(model, device), []

        def loss_fn(ids, mask):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), sig)  # arrives mid-step
            return inner(ids, mask)
        return loss_fn

    args = ["train-lm", "--corpus", str(corpus), "--held-out", "mod0.py", "--steps", "4", "--batch-size", "2",
            "--seq-len", "16", "--vocab-size", "280", "--d-model", "32", "--n-layer", "1", "--d-state", "8",
            "--headdim", "16", "--eval-tokens", "200", "--save-every", "10"]
    assert cli_main(args + ["--out", str(tmp_path / "whole")]) == 0
    monkeypatch.setattr(module, "lm_loss", signalling_loss)
    assert cli_main(args + ["--out", str(tmp_path / "cut")]) == 128 + sig
    err = capsys.readouterr().err.strip()  # tqdm's bar, then the one line
    last = err.splitlines()[-1]
    assert "Traceback" not in err and last.startswith("stree train-lm: interrupted by") and "--resume" in last
    assert f"interrupted by {signum} after step 2" in last
    assert torch.load(tmp_path / "cut" / "train_state.pt", weights_only=True)["step"] == 2
    monkeypatch.setattr(module, "lm_loss", real)
    assert cli_main(args + ["--out", str(tmp_path / "cut"), "--resume"]) == 0
    whole, cut = load(tmp_path / "whole").state_dict(), load(tmp_path / "cut").state_dict()
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
