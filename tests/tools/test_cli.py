"""`stree generate` on a tiny checkpoint directory with its own tokenizer."""

import subprocess
import sys

import pytest
import torch
from tiny_models import mamba2

from stree.tools.cli import main
from stree.drafters.registry import drafter_name
from stree.models import load, save
from stree.tree import TreeShape

TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n"


def tokenizer_files(path, vocab=120):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return len(fast)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    n = tokenizer_files(path)
    save(mamba2(vocab_size=n), path, format="mamba_ssm")
    return path


def test_generate_prints_text_stats_and_comparison(checkpoint, capsys):
    rc = main(["generate", "--model", str(checkpoint), "--prompt", "def f(x):\n    return", "--tree", "full:2x3",
               "--max-new-tokens", "12", "--compare"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0].startswith("def f(x):")
    stats = [line for line in out if line.startswith("[stree]")]
    assert len(stats) == 1 and "tau" in stats[0] and "tok/s" in stats[0]
    assert any(line.startswith("[autoregressive]") for line in out)
    assert out[-1].startswith("speedup x") and out[-1].endswith("greedy outputs identical: yes")


def test_generate_compiled_equals_eager_with_an_ssm_drafter(checkpoint, tmp_path, capsys):
    """--compile: the target's and the drafter model's calls compiled, the same greedy text. (One
    explicit tree: under tree="auto" a compiled call builds and times the pass of every fixed size
    and the drafter's steps for each, several times this test's cost; tests/runtime/test_compiled.py
    builds those.)"""
    drafter = tmp_path / "drafter"
    save(mamba2(vocab_size=load(checkpoint).vocab_size, seed=1, n_layer=1), drafter, format="mamba_ssm")
    argv = ["generate", "--model", str(checkpoint), "--prompt", "def f(x):", "--drafter", "ssm-static",
            "--drafter-model", str(drafter), "--tree", "full:2x2", "--max-new-tokens", "8",
            "--device", "cpu"]  # --compile: the CPU's path
    assert main(argv) == 0
    eager = capsys.readouterr().out.splitlines()[0]
    assert main(argv + ["--compile"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == eager


def test_generate_sampling_and_tree_file(checkpoint, tmp_path, capsys):
    shape = tmp_path / "tree.json"
    TreeShape.from_children([2, 1, 1]).save(shape)
    argv = ["generate", "--model", str(checkpoint), "--prompt", "class A:", "--tree", str(shape), "--temperature",
            "0.8", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "8"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0] == first  # same seed, same text


def test_generate_over_a_dynamic_tree(checkpoint, capsys):
    """--tree dynamic:N with STAND: the greedy text of the autoregressive run (--compare)."""
    rc = main(["generate", "--model", str(checkpoint), "--prompt", "def f(x):\n    return", "--tree", "dynamic:12x4",
               "--drafter", "stand", "--max-new-tokens", "12", "--compare"])
    assert rc == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("greedy outputs identical: yes")


def test_errors_exit_2_with_the_reason(checkpoint, tmp_path, capsys):
    assert main(["generate", "--model", str(checkpoint), "--prompt", "x", "--tree", "full:2"]) == 2
    assert "bad tree spec 'full:2'" in capsys.readouterr().err
    assert main(["generate", "--model", str(checkpoint), "--prompt", "x", "--tree", "dynamic:16"]) == 2
    err = capsys.readouterr().err
    assert "NGramDrafter drafts static tree shapes" in err and len(err.splitlines()) == 1
    assert main(["generate", "--model", str(checkpoint), "--prompt", "", "--max-new-tokens", "3"]) == 2
    assert "prompt 0 ('') encodes to no tokens" in capsys.readouterr().err
    small = tmp_path / "small"
    small.mkdir()
    n = tokenizer_files(small)
    save(mamba2(vocab_size=n - 10, pad_vocab_size_multiple=1), small, format="mamba_ssm")
    assert main(["generate", "--model", str(small), "--prompt", "x"]) == 2
    assert f"has {n} tokens but the model's vocab_size is {n - 10}" in capsys.readouterr().err


def test_module_entry_point(checkpoint):
    run = subprocess.run([sys.executable, "-m", "stree", "generate", "--model", str(checkpoint), "--prompt", "def",
                          "--method", "chain", "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1].startswith("[chain] tokens 4")


def test_optimize_tree_writes_a_tree_generate_can_use(checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nclass A:\n    return x\n")
    out = tmp_path / "tree.json"
    rc = main(["optimize-tree", "--model", str(checkpoint), "--prompts", str(prompts), "--out", str(out), "--nodes", "12",
               "--max-new-tokens", "10", "--temperature", "0"])
    assert rc == 0, capsys.readouterr().err
    assert "3 prompts" in capsys.readouterr().out
    shape = TreeShape.load(out)
    assert shape.n <= 13
    assert main(["generate", "--model", str(checkpoint), "--prompt", "def f", "--tree", str(out), "--drafter", "stand",
                 "--max-new-tokens", "6", "--compare"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("identical: yes")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["optimize-tree", "--model", str(checkpoint), "--prompts", str(empty), "--out", str(out)]) == 2
    assert "holds no prompts" in capsys.readouterr().err


@pytest.mark.parametrize("drafter", ["ssm", "ssm-static", "ssm-beam"])  # ssm: the text API's name for ssm-static
def test_generate_with_a_drafter_model(checkpoint, tmp_path, capsys, drafter):
    small = tmp_path / "drafter"
    save(mamba2(vocab_size=load(checkpoint).cfg.vocab_size, n_layer=1, seed=5), small)  # an unrelated drafter
    argv = ["generate", "--model", str(checkpoint), "--prompt", "def f(x):", "--drafter", drafter,
            "--drafter-model", str(small), "--max-new-tokens", "10", "--compare"]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("identical: yes")
    assert main(argv[:-5] + ["--max-new-tokens", "3"]) == 2
    assert f"--drafter {drafter_name(drafter)} needs --drafter-model DIR" in capsys.readouterr().err
    assert main(["generate", "--model", str(checkpoint), "--prompt", "x", "--drafter-model", str(small)]) == 2
    assert "--drafter-model is only for" in capsys.readouterr().err


def test_transformers_checkpoint_without_a_tokenizer_takes_tokenizer(tmp_path, capsys):
    """A transformers-saved Bamba directory holds no tokenizer (as state-spaces ships mamba_ssm
    checkpoints): --tokenizer names one; without it the error is one line, exit 2."""
    from hf_families import save_tiny

    tok = tmp_path / "tok"
    n = tokenizer_files(tok)
    save_tiny("bamba", tmp_path / "model", vocab_size=n)
    capsys.readouterr()  # transformers' own progress output
    argv = ["generate", "--model", str(tmp_path / "model"), "--prompt", "def f(x):", "--max-new-tokens", "6",
            "--compare"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no tokenizer" in err
    assert main(argv + ["--tokenizer", str(tok)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("greedy outputs identical: yes")


def test_prompt_file_stdin_stop_and_json(checkpoint, tmp_path, capsys, monkeypatch):
    """Several prompts as one batch from a file (lines or JSONL) or stdin; --json output; --stop."""
    import io
    import json

    lines = tmp_path / "prompts.txt"
    lines.write_text("def f(x):\n\nclass A:\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"prompt": "class A:"}) + "\n")
    base = ["generate", "--model", str(checkpoint), "--max-new-tokens", "10", "--json"]
    reports = []
    for source in (["--prompt-file", str(lines)], ["--prompt-file", str(jsonl)], []):
        if not source:
            monkeypatch.setattr("sys.stdin", io.StringIO(jsonl.read_text()))
        assert main(base + source) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == {**reports[1], "stats": reports[0]["stats"]} == {**reports[2], "stats": reports[0]["stats"]}
    report = reports[0]
    assert len(report["texts"]) == 2 and report["finish_reasons"] == ["length", "length"]
    assert report["stats"]["new_tokens"] == [10, 10] and report["stats"]["tau"] >= 1
    stop = report["texts"][0][2:4]
    assert main(base + ["--prompt-file", str(lines), "--stop", stop, "--compare"]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["texts"][0] == report["texts"][0][: report["texts"][0].index(stop)]
    assert stopped["finish_reasons"][0] == "stop" and stopped["identical"] is True
    assert main(["generate", "--model", str(checkpoint), "--prompt-file", str(lines), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "=== prompt 0 (length) ===" and out[1].startswith("def f(x):")


def test_generate_reports_logprobs_in_its_json(checkpoint, capsys):
    """``--logprobs K`` with ``--json``: per row, each generated token's log-probability and top K,
    as ``LM.generate(logprobs=K)`` gives them; without ``--json``, or below 0, one line and exit 2."""
    import json

    import stree

    args = ["generate", "--model", str(checkpoint), "--prompt", "def f(x):", "--max-new-tokens", "5", "--json"]
    assert main(args + ["--logprobs", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    ref = stree.LM.from_pretrained(str(checkpoint)).generate("def f(x):", max_new_tokens=5, logprobs=2)
    (row,) = report["logprobs"]
    assert [x["token"] for x in row] == report["token_ids"][0] == ref.token_ids[0]
    assert [x["logprob"] for x in row] == pytest.approx([lp.logprob for lp in ref.logprobs[0]], abs=1e-4)
    assert [[i for i, _ in x["top"]] for x in row] == [[i for i, _ in lp.top] for lp in ref.logprobs[0]]
    for bad, says in ((["--logprobs", "2"], "--logprobs takes K >= 0 and goes with --json, got 2 without --json"),
                      (["--json", "--logprobs", "-1"], "--logprobs takes K >= 0 and goes with --json, got -1")):
        assert main(args[:-1] + bad) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.splitlines()) == 1


def test_prompt_source_errors_exit_2(checkpoint, tmp_path, capsys, monkeypatch):
    import io

    base = ["generate", "--model", str(checkpoint)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    for argv, message in ((["--prompt", "x", "--prompt-file", str(bad)], "give --prompt or --prompt-file, not both"),
                          (["--prompt-file", str(bad)], f"--prompt-file {bad} line 2: not a JSON object with a 'prompt'"),
                          (["--prompt-file", str(empty)], f"--prompt-file {empty} holds no prompts"),
                          (["--prompt-file", str(tmp_path / "none.txt")], "none.txt: no such file")):
        assert main(base + argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(base) == 2 and "stdin holds no prompts" in capsys.readouterr().err


def test_reason_prints_text_and_stats_and_json(capsys):
    """`stree reason` on the shipped pair: the text, the accepted share and the time split; --json
    the steps and stats; a bad value one line, exit 2."""
    import json

    from stree.tools.demo import DRAFTER, TARGET
    from stree.models import load_tokenizer

    args = ["reason", "--model", str(TARGET), "--small-model", str(DRAFTER), "--prompt", "def add(a, b):",
            "--max-new-tokens", "24", "--dtype", "float32"]
    assert main(args + ["--judge", "logprob", "--threshold", "-2.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def add(a, b):") and "[reason] steps" in out and "small's kept" in out
    assert main(args + ["--json", "--token-spec", "off", "--step-delimiter", "\\n"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["token_ids"]) == 24 and report["stats"]["judged"] == len(report["steps"]) >= 2
    tok = load_tokenizer(TARGET)
    for step in report["steps"][:-1]:  # each step ends with the token that completes its first newline
        assert "\n" in step["text"] and "\n" not in tok.decode(step["tokens"][:-1])
    assert main(args + ["--max-step-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_step_tokens must be" in err


def test_samples_of_one_prompt_draft_from_each_other(capsys):
    """--num-samples: one prompt's sampled trajectories in one batch; with the consensus drafter
    each drafts from the others (not only from itself)."""
    import json

    from stree.tools.demo import TARGET

    taus = {"together": 0.0, "alone": 0.0}
    for seed in range(4):  # (summed over seeds: one seed's texts may offer each other little)
        args = ["generate", "--model", str(TARGET), "--prompt", "def add(a, b):", "--num-samples", "4",
                "--max-new-tokens", "24", "--drafter", "consensus", "--temperature", "0.3", "--seed", str(seed),
                "--dtype", "float32", "--tree", "paper13"]  # a fixed tree: acceptance compared, not "auto"'s choice
        assert main(args + ["--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert len(report["texts"]) == 4 and len(set(report["texts"])) > 1
        assert main(args[:5] + ["--num-samples", "1"] + args[7:] + ["--json"]) == 0
        taus["together"] += report["stats"]["tau"]
        taus["alone"] += json.loads(capsys.readouterr().out)["stats"]["tau"]
    assert taus["together"] > taus["alone"]  # the samples' drafts come from one another
    assert main(args) == 0
    assert "=== prompt 0 sample 3 (length) ===" in capsys.readouterr().out
    assert main(args[:5] + ["--num-samples", "0"]) == 2
    assert "--num-samples must be >= 1" in capsys.readouterr().err


def test_profile_prints_the_cost_table_and_plots_it(checkpoint, tmp_path, capsys):
    import json

    png = tmp_path / "cost.png"
    assert main(["profile", "--model", str(checkpoint), "--drafter", "stand-det", "--png", str(png), "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    nodes = [r["nodes"] for r in table["rows"]]
    assert nodes[0] == 1 and nodes == sorted(nodes) and len(nodes) > 3
    assert table["mode"] == ("cuda_graph" if torch.cuda.is_available() else "eager")  # the default device's
    assert table["rows"][0]["steps"] == 1.0 and all(r["target_ms"] > 0 and r["steps"] > 0 for r in table["rows"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["profile", "--model", str(checkpoint), "--png", str(png)]) == 0  # cached: the table again
    out = capsys.readouterr().out
    assert "nodes" in out and "in steps" in out and "costs.json" in out
    assert main(["profile", "--model", str(checkpoint), "--png", str(png), "--dtype", "float32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["nodes"] == 1
    assert table["drafter_step_ms"] is None and table["drafter_level_ms"] is None  # STAND runs no model
    small = tmp_path / "drafter"
    save(mamba2(vocab_size=load(checkpoint).cfg.vocab_size, n_layer=1, seed=5), small)
    assert main(["profile", "--model", str(checkpoint), "--drafter", "ssm", "--drafter-model", str(small),
                 "--png", str(png)]) == 0
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("drafter model: ")]
    assert float(line.split()[2]) > 0 and "of the target's" in line
    assert main(["profile", "--model", str(checkpoint), "--drafter", "ssm", "--drafter-model", str(small),
                 "--png", str(png), "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert 0 < table["drafter_step_ms"] and 0 < table["target_step_ms"] and table["drafter_level_ms"] >= 0
    for bad in (["--batch-size", "0"], ["--drafter", "ssm-static"], ["--drafter", "ssm"]):
        assert main(["profile", "--model", str(checkpoint), "--png", str(png), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("stree profile: error:")


def test_generate_takes_its_defaults_from_generation_config(checkpoint, tmp_path, capsys):
    """The checkpoint's do_sample / temperature / top_k / max_new_tokens are the defaults, a flag
    overrides its own value, and the output says which values were used and where they came from."""
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps(dict(do_sample=True, temperature=0.8, top_k=4,
                                                                 max_new_tokens=5)))
    argv = ["generate", "--model", str(ckpt), "--prompt", "def f(x):", "--seed", "2", "--json", "--dtype", "float32"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    g = report["generation"]
    assert (g["temperature"], g["top_k"], g["top_p"], g["max_new_tokens"]) == (0.8, 4, 1.0, 5)
    assert g["from_checkpoint"] == ["max_new_tokens", "temperature", "top_k"] and len(report["token_ids"][0]) <= 5
    assert main(argv + ["--temperature", "0", "--max-new-tokens", "3"]) == 0
    g = json.loads(capsys.readouterr().out)["generation"]
    assert (g["temperature"], g["max_new_tokens"], g["from_checkpoint"]) == (0.0, 3, ["top_k"])
    assert main(argv[:-3]) == 0  # the text report names them too
    assert "[decoding] max_new_tokens 5 temperature 0.8 top_k 4 top_p 1.0 (from generation_config.json: " \
           "max_new_tokens, temperature, top_k)" in capsys.readouterr().out
