"""Checkpoints by Hub id, offline: a Hub cache laid out in a temporary directory as
huggingface_hub writes it (``models--org--name/snapshots/<commit>/``, ``refs/<branch>``), loaded by
id from Python and the CLI; a local directory wins over an id spelled the same; what cannot be had
is one clear error naming the id."""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants

import stree
from stree.tools.demo import DRAFTER, TARGET
from stree.models import load, load_tokenizer
from stree.checkpoints.hub import PICKLED, READ, is_repo_id, resolve

REPO, COMMIT, TAG_COMMIT = "stree-test/tiny", "a" * 40, "b" * 40
SMALL = "stree-test/small"  # the shipped drafter, at main
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _cached(root, repo_id: str, refs: dict) -> None:
    """``repo_id`` in the Hub cache at ``root``: each ref names a (commit, source directory)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    for ref, (commit, source) in refs.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for name in FILES:
            if (source / name).exists():
                shutil.copy(source / name, snapshot / name)
        (repo / "refs" / ref).write_text(commit)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The shipped target cached as ``stree-test/tiny`` at main and the drafter at its tag
    ``small``, and the drafter as ``stree-test/small``; huggingface_hub pointed at it, offline."""
    root = tmp_path / "hub"
    _cached(root, REPO, {"main": (COMMIT, TARGET), "small": (TAG_COMMIT, DRAFTER)})
    _cached(root, SMALL, {"main": ("c" * 40, DRAFTER)})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root


def test_a_hub_id_loads_from_the_cache_as_its_directory_does(hub):
    by_id = stree.LM.from_pretrained(REPO, dtype=torch.float32, device="cpu")
    by_dir = stree.LM.from_pretrained(TARGET, dtype=torch.float32, device="cpu")
    kw = dict(max_new_tokens=12, drafter="ngram")
    assert by_id.generate(["def f(x):"], **kw).token_ids == by_dir.generate(["def f(x):"], **kw).token_ids
    assert resolve(REPO) == hub / "models--stree-test--tiny" / "snapshots" / COMMIT


def test_a_drafter_model_and_a_tokenizer_load_by_id(hub):
    lm = stree.LM.from_pretrained(TARGET, dtype=torch.float32, device="cpu", drafter_model=SMALL, tokenizer=REPO)
    assert lm.drafter_model.cfg == load(DRAFTER).cfg and len(lm.tokenizer) == len(load_tokenizer(TARGET))
    assert lm.generate(["def f(x):"], max_new_tokens=6, drafter="ssm").token_ids == \
        lm.generate(["def f(x):"], max_new_tokens=6, method="autoregressive").token_ids


def test_a_revision_picks_its_snapshot_and_a_missing_one_is_named(hub):
    small = load(REPO, revision="small")
    assert small.cfg == load(DRAFTER).cfg and small.cfg != load(REPO).cfg
    assert load(REPO, revision=COMMIT).cfg == load(TARGET).cfg
    assert len(load_tokenizer(REPO, revision="small")) == len(load_tokenizer(DRAFTER))
    with pytest.raises(ValueError, match=r"the Hub id 'stree-test/tiny' at revision 'v9' is not in the Hub cache"):
        load(REPO, revision="v9")


def test_an_id_not_in_the_cache_offline_is_one_error_naming_it(hub):
    with pytest.raises(ValueError, match=r"'nobody/nothing' is not a local directory, and the Hub id "
                                         r"'nobody/nothing' is not in the Hub cache"):
        stree.LM.from_pretrained("nobody/nothing")


def test_a_local_directory_wins_over_an_id_spelled_the_same(hub, tmp_path, monkeypatch):
    local = tmp_path / "work" / "stree-test" / "tiny"
    shutil.copytree(DRAFTER, local)
    monkeypatch.chdir(tmp_path / "work")
    assert load(REPO).cfg == load(DRAFTER).cfg
    with pytest.raises(ValueError, match=r"revision='main' is for Hub ids; 'stree-test/tiny' is a local path"):
        load(REPO, revision="main")


def test_names_that_cannot_be_ids_stay_paths():
    assert not is_repo_id("./models/tiny") and not is_repo_id("a/b/c") and not is_repo_id("/abs/path")
    assert is_repo_id("org/name") and is_repo_id("gpt2")
    with pytest.raises(FileNotFoundError, match="checkpoint directory a/b/c does not exist"):
        load("a/b/c")
    with pytest.raises(TypeError, match="revision must be a str"):
        resolve("org/name", revision=3)


def test_only_the_files_stree_reads_are_fetched(tmp_path, monkeypatch):
    """Configs, safetensors and tokenizer files; torch-pickled weights only where a repository
    has no safetensors. Offline, the cache alone is asked (huggingface_hub 1.x would otherwise ask
    the Hub for a commit's file list, and refuse itself)."""
    calls = []

    def fake(repo, revision=None, allow_patterns=None, local_files_only=False):
        calls.append((allow_patterns, local_files_only))
        folder = tmp_path / repo.replace("/", "--")
        folder.mkdir(exist_ok=True)
        if repo == "org/safe":
            (folder / "model.safetensors").touch()
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    resolve("org/safe")
    assert calls == [(READ, False)] and not any(p in READ for p in PICKLED)
    calls.clear()
    resolve("org/pickled")
    assert calls == [(READ, False), (READ + PICKLED, False)]
    calls.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    resolve("org/pickled", "a" * 40)
    assert calls == [(READ, True), (READ + PICKLED, True)]


def test_the_cli_takes_a_hub_id_and_names_one_it_cannot_have(hub, capsys):
    """As commands (a process that finds the cache by its environment) and, for the rest, through the
    CLI's main in this process (the fixture points huggingface_hub at the cache)."""
    from stree.tools.cli import main

    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    generate = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--dtype", "float32", "--device", "cpu",
                "--model"]
    commands = {"ok": generate + [REPO],
                "by_ids": generate + [str(TARGET), "--tokenizer", REPO, "--drafter", "ssm-static", "--drafter-model",
                                      SMALL]}
    with ThreadPoolExecutor(2) as pool:  # (processes that mostly import: two at a time on two cores)
        ok, by_ids = pool.map(lambda argv: subprocess.run(
            [sys.executable, "-m", "stree", *argv], capture_output=True, text=True, env=env, timeout=300),
            commands.values())
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("def f(x):")
    assert by_ids.returncode == 0, by_ids.stderr
    assert by_ids.stdout.splitlines()[0] == ok.stdout.splitlines()[0]  # greedy: the same text by any drafter

    def run(argv):
        code = main(argv)
        return code, capsys.readouterr()
    code, small = run(generate + [REPO, "--revision", "small"])
    assert code == 0 and small.out.startswith("def f(x):"), small.err
    code, bad = run(generate + ["nobody/nothing"])
    assert code == 2 and bad.err.count("\n") == 1 and "Traceback" not in bad.err
    assert "'nobody/nothing' is not a local directory, and the Hub id 'nobody/nothing' is not in the Hub cache" in \
        bad.err
    for argv in (["distill", "--target", "nobody/nothing", "--out", str(hub / "out")],
                 ["reason", "--model", REPO, "--small-model", "nobody/nothing", "--prompt", "def f(x):"]):
        code, bad = run(argv)
        assert code == 2 and bad.err.count("\n") == 1 and "'nobody/nothing'" in bad.err, argv[0]
