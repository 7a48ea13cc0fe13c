"""Drafters by name, as the command line, the demo and the acceptance benchmark choose them."""

from __future__ import annotations

from ..tree import TreeShape
from .base import Drafter
from .consensus import ConsensusDrafter, PathStore
from .ngram import NGramDrafter
from .ssm import SSMDrafter
from .stand import STANDDrafter, STANDStore

DRAFTER_NAMES = ("ngram", "stand", "stand-det", "consensus", "ssm-static", "ssm-beam")
NEEDS_MODEL = ("ssm-static", "ssm-beam")


def make_drafter(name: str, *, drafter_model=None, vocab_size: int | None = None, temperature: float = 0.0,
                 store=None, include_self: bool = False, seed: int = 0) -> Drafter:
    """``stand`` / ``stand-det``: STAND with Gumbel-top-k stochastic or top-k trees (``store``: a
    shared :class:`STANDStore`); ``consensus``: a :class:`ConsensusDrafter` (``store``: a shared
    :class:`PathStore`); ``ssm-static``: ``drafter_model`` filling the paper's 13-node tree, by
    draws without replacement at ``temperature`` when it is > 0, else top-k; ``ssm-beam``: 3 beams
    x 4 steps (13 nodes, paper 001 App. C). ``vocab_size``: the target's, for a padded drafter."""
    if name not in DRAFTER_NAMES:
        raise ValueError(f"drafter must be one of {DRAFTER_NAMES}, got {name!r}")
    if (drafter_model is None) == (name in NEEDS_MODEL):
        need = "needs" if name in NEEDS_MODEL else "takes no"
        raise ValueError(f"drafter {name!r} {need} a drafter model")
    if store is not None and name not in ("stand", "stand-det", "consensus"):
        raise ValueError(f"drafter {name!r} takes no store")
    if name == "ngram":
        return NGramDrafter()
    if name in ("stand", "stand-det"):
        return STANDDrafter(STANDStore() if store is None else store, stochastic=name == "stand", seed=seed)
    if name == "consensus":
        return ConsensusDrafter(PathStore() if store is None else store, include_self=include_self)
    if name == "ssm-beam":
        return SSMDrafter(drafter_model, mode="beam", beams=3, steps=4, vocab_size=vocab_size, seed=seed)
    return SSMDrafter(drafter_model, TreeShape.paper13(), stochastic=temperature > 0,
                      temperature=temperature if temperature > 0 else 1.0, vocab_size=vocab_size, seed=seed)
