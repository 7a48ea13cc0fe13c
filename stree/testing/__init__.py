"""Helpers for checking stree against obviously-correct definitions (used by tests and selfcheck)."""

from .definitions import (
    max_rel_error,
    multistep_def,
    random_ssm_inputs,
    replay_def,
    tree_attention_def,
    tree_conv1d_def,
    tree_scan_def,
)

__all__ = [
    "max_rel_error",
    "multistep_def",
    "random_ssm_inputs",
    "replay_def",
    "tree_attention_def",
    "tree_conv1d_def",
    "tree_scan_def",
]
