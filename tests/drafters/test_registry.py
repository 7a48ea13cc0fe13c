"""One registry names the drafters: every entry point that takes a drafter's name (the text API,
search, test-time scaling, SpecReason) resolves it through it and accepts the same names, with
the same errors."""

import pytest
import torch

from stree.patterns import reasoning
from stree.patterns import search
from stree.patterns import tts
from stree.drafters import ConsensusDrafter, NGramDrafter, PathStore, PerRowDrafter, SSMDrafter, STANDDrafter, STANDStore
from stree.drafters.registry import (DRAFTER_ALIASES, DRAFTER_NAMES, NEEDS_MODEL, drafter_name, random_drafts,
                                    resolve_drafter)
from stree.testing import MarkovLM

KIND = {"ngram": NGramDrafter, "stand": STANDDrafter, "stand-det": STANDDrafter, "consensus": ConsensusDrafter,
        "ssm-static": SSMDrafter, "ssm-beam": SSMDrafter}
NAMES = sorted({*DRAFTER_NAMES, *DRAFTER_ALIASES})


def _small():
    torch.manual_seed(0)  # Dirichlet draws from the global generator
    return MarkovLM(torch.distributions.Dirichlet(torch.full((12,), 0.5, dtype=torch.float64)).sample((12, 12)))


def _entry_points(small=None):
    """name -> drafter, as each entry point makes it (the model drafters where one is given)."""
    return {
        "resolve_drafter": lambda name: resolve_drafter(name, drafter_model=small),
        "search": lambda name: search._drafter(name, None, True)[0],
        "tts": lambda name: tts._drafter(name, None)[0],
        "reasoning": lambda name: reasoning._drafter(name, small, 0.0),
    }


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_point_takes_every_name(name):
    small = _small()
    for where, make in _entry_points(small).items():
        if where in ("search", "tts") and drafter_name(name) in NEEDS_MODEL:
            with pytest.raises(ValueError, match=f"drafter '{drafter_name(name)}' needs a drafter model"):
                make(name)  # (they take no drafter model)
            continue
        drafter = make(name)
        assert type(drafter) is KIND[drafter_name(name)], where


@pytest.mark.parametrize("where", ["resolve_drafter", "search", "tts", "reasoning"])
def test_an_unknown_name_is_the_same_error_everywhere(where):
    make = _entry_points()[where]
    with pytest.raises(ValueError, match=r"must be one of .*'ssm', 'ssm-beam', 'ssm-static', 'stand', 'stand-det'.*"
                                         r"got 'medusa'"):
        make("medusa")
    with pytest.raises(TypeError, match="must be a drafter name or a Drafter, got int"):
        make(3)


def test_stores_are_shared_where_the_drafter_keeps_one_and_checked():
    drafter, store = tts._drafter("consensus", None)
    assert isinstance(store, PathStore) and drafter.store is store
    drafter, store = search._drafter("stand-det", None, True)
    assert isinstance(store, STANDStore) and drafter.store is store
    assert isinstance(search._drafter("stand", None, False)[0], PerRowDrafter)  # a fresh store per branch
    with pytest.raises(TypeError, match="drafter 'consensus' needs a PathStore, got STANDStore"):
        search._drafter("consensus", STANDStore(capacity=4), True)
    with pytest.raises(ValueError, match="drafter 'ngram' takes no store"):
        search._drafter("ngram", PathStore(), True)


@pytest.mark.parametrize("name", NAMES)
def test_the_registry_knows_which_drafters_draft_randomly_before_making_them(name):
    """What the serving engine reads to decide a seeded request's cohort is what the drafter made at
    that temperature says (Drafter.random_drafts); no drafter drafts randomly for greedy rows."""
    for temperature in (0.5, 1.0):
        drafter = resolve_drafter(name, drafter_model=_small(), temperature=temperature)
        assert random_drafts(name, temperature) == drafter.random_drafts, (name, temperature)
    assert not random_drafts(name, 0.0) and not random_drafts(None, 1.0)
    made = lambda: resolve_drafter(name, drafter_model=_small(), temperature=1.0)
    assert PerRowDrafter(made).random_drafts == made().random_drafts  # (a drafter per row: its kind's)
