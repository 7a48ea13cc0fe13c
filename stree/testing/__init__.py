"""Helpers for checking stree against obviously-correct definitions (used by tests and selfcheck)."""

from .definitions import (
    gated_rms_norm_def,
    max_rel_error,
    multistep_def,
    random_ssm_inputs,
    replay_def,
    rms_norm_def,
    root_path,
    tree_attention_def,
    tree_conv1d_def,
    tree_scan_def,
)
from .markov import MarkovCache, MarkovDrafter, MarkovLM
from .sequential import sequential_logits, two_token_law
from .stats import cell_counts, chi_square

__all__ = [
    "MarkovCache",
    "MarkovDrafter",
    "MarkovLM",
    "cell_counts",
    "chi_square",
    "gated_rms_norm_def",
    "max_rel_error",
    "multistep_def",
    "random_ssm_inputs",
    "replay_def",
    "rms_norm_def",
    "root_path",
    "sequential_logits",
    "tree_attention_def",
    "two_token_law",
    "tree_conv1d_def",
    "tree_scan_def",
]
