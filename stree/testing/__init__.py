"""Helpers for checking stree against obviously-correct definitions (used by tests and selfcheck)."""

from .definitions import (
    max_rel_error,
    multistep_def,
    random_ssm_inputs,
    replay_def,
    root_path,
    tree_attention_def,
    tree_conv1d_def,
    tree_scan_def,
)
from .sequential import sequential_logits

__all__ = [
    "max_rel_error",
    "multistep_def",
    "random_ssm_inputs",
    "replay_def",
    "root_path",
    "sequential_logits",
    "tree_attention_def",
    "tree_conv1d_def",
    "tree_scan_def",
]
