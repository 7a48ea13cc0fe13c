"""Calibrate a static draft tree on prompts (STAND appendix A): decode with a large initial tree,
count per-node acceptance, keep the most accepted nodes."""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..drafters.base import Drafter
from ..drafters.calibrate import AcceptanceCounter, optimize_tree, stand_initial_tree
from ..decoding.loop import generate
from ..tree import TreeShape


def calibrate(model, prompts, drafter: Drafter, shape: TreeShape, *, temperature: float = 0.6,
              max_new_tokens: int = 256, seed: int = 0, reset_store: bool = True, progress: bool = False) -> torch.Tensor:
    """Decode each prompt (a token list) with ``drafter`` over ``shape``; returns per-node counts of
    being on the accepted path. ``reset_store``: a drafter with a ``store`` starts each prompt
    (problem) from an empty store."""
    counter = AcceptanceCounter(shape)
    for i, prompt in enumerate(tqdm(prompts, desc="calibrating", disable=not progress)):
        if reset_store and hasattr(drafter, "store"):
            drafter.store.clear()
        generate(model, [prompt], drafter=drafter, tree=shape, max_new_tokens=max_new_tokens, temperature=temperature,
                 seed=seed + i, on_step=counter)
    return counter.counts


def optimize_static_tree(model, prompts, drafter: Drafter, *, initial: TreeShape | None = None, nodes: int = 80,
                         **calibrate_kw) -> tuple[TreeShape, torch.Tensor]:
    """The optimised tree and the counts it came from; ``initial`` defaults to STAND's 625 nodes."""
    initial = initial or stand_initial_tree()
    counts = calibrate(model, prompts, drafter, initial, **calibrate_kw)
    return optimize_tree(initial, counts, nodes), counts
