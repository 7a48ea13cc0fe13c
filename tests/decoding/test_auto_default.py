"""tree="auto" is the default of every entry point that drafts (issue 31 §4): called without a
tree, each of them reaches the decoding loop's chooser (``auto_tree``) for its drafter; given an
explicit tree, none does. (The serving engine's cohorts have their own test:
tests/serving/test_engine.py.)"""

import pytest
import torch

import stree.decoding.loop as loop
from stree.decoding.loop import decode, drain, generate
from stree.drafters import NGramDrafter
from stree.lm import LM
from stree.models import load
from stree.patterns.reasoning import spec_reason
from stree.patterns.search import beam_search, dvts
from stree.patterns.tts import sample_trajectories
from stree.tools.cli import main
from stree.tools.demo import DRAFTER, TARGET
from stree.tree import TreeShape

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def lm():
    return LM.from_pretrained(TARGET, dtype="float32")


@pytest.fixture
def chooser_calls(monkeypatch):
    """The drafters the loop built a chooser for, in order."""
    calls = []
    real = loop.auto_tree

    def spy(model, drafter, batch, **kw):
        calls.append(type(drafter).__name__)
        return real(model, drafter, batch, **kw)

    monkeypatch.setattr(loop, "auto_tree", spy)
    return calls


def _entries(lm):
    """Every entry point that takes a tree, called with its defaults and ``extra`` (an explicit tree)."""
    ids = [lm.tokenizer.encode(PROMPT)]
    judge = lambda context, step: 0.0  # noqa: E731
    return {
        "generate": lambda **extra: generate(lm.model, ids, drafter=NGramDrafter(), max_new_tokens=8, **extra),
        "decode": lambda **extra: drain(decode(lm.model, ids, drafter=NGramDrafter(), max_new_tokens=8, **extra)),
        "LM.generate": lambda **extra: lm.generate(PROMPT, max_new_tokens=8, **extra),
        "LM.stream": lambda **extra: list(lm.stream(PROMPT, max_new_tokens=8, **extra)),
        "beam_search": lambda **extra: beam_search(lm.model, ids[0], width=1, expand=2, steps=1, scorer=judge,
                                                   max_step_tokens=6, max_new_tokens=6, stop=None, **extra),
        "dvts": lambda **extra: dvts(lm.model, ids[0], width=1, expand=2, steps=1, scorer=judge, max_step_tokens=6,
                                     max_new_tokens=6, stop=None, **extra),
        "sample_trajectories": lambda **extra: sample_trajectories(lm.model, ids[0], 2, max_new_tokens=8, seed=0,
                                                                   **extra),
    }


@pytest.mark.parametrize("entry", ["generate", "decode", "LM.generate", "LM.stream", "beam_search", "dvts",
                                   "sample_trajectories"])
def test_entry_points_choose_trees_by_default_and_honour_an_explicit_one(lm, chooser_calls, entry):
    call = _entries(lm)[entry]
    call()
    assert chooser_calls, f"{entry} without a tree built no chooser"
    chooser_calls.clear()
    call(tree=TreeShape.paper13())
    assert chooser_calls == [], f"{entry} with an explicit tree built a chooser: {chooser_calls}"


def test_spec_reason_drafts_the_base_models_steps_by_the_choice(lm, chooser_calls):
    small = load(DRAFTER, dtype=torch.float32)
    spec_reason(lm.model, small, lm.tokenizer, PROMPT, judge=lambda context, step: 0.0, threshold=1,
                max_new_tokens=8, max_step_tokens=8, eos_token_id=[], small_spec=False)
    assert "STANDDrafter" in chooser_calls  # token_spec=True: the base model's steps through STAND, tree="auto"


def test_the_cli_passes_auto_unless_told(monkeypatch, capsys):
    trees = []
    real = LM.generate

    def spy(self, prompts, **kw):
        trees.append(kw.get("tree", "auto"))
        return real(self, prompts, **kw)

    monkeypatch.setattr(LM, "generate", spy)
    assert main(["generate", "--model", str(TARGET), "--prompt", PROMPT, "--max-new-tokens", "4"]) == 0
    assert main(["generate", "--model", str(TARGET), "--prompt", PROMPT, "--max-new-tokens", "4",
                 "--tree", "paper13"]) == 0
    capsys.readouterr()
    assert trees[0] == "auto" and isinstance(trees[1], TreeShape) and trees[1].n == 13
