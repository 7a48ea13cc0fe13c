"""Tree kernels for Mamba2 and the hybrids' attention layers: each has a Triton kernel and a ``*_ref`` PyTorch reference.

``backend="auto"`` runs Triton on CUDA tensors and the reference on CPU tensors, except the
decode step's two kernels and replay, which run numba-compiled on CPU float32 tensors
(:mod:`.step_jit`, :mod:`.replay_jit`); ``"torch"`` is the reference anywhere; ``"triton"`` on
CPU tensors needs ``TRITON_INTERPRET=1`` set before this package is imported.
"""

from .conv_step import conv_step, conv_step_ref
from .gated_norm import gated_rms_norm, gated_rms_norm_ref
from .multistep import multistep_update, multistep_update_ref, selective_state_update, selective_state_update_ref
from .replay import check_accepted, replay, replay_ref
from .tree_attention import tree_attention, tree_attention_ref
from .tree_conv1d import tree_conv1d, tree_conv1d_ref
from .tree_scan import MAX_TREE_NODES, tree_scan, tree_scan_ref

__all__ = [
    "tree_scan",
    "tree_scan_ref",
    "tree_conv1d",
    "tree_conv1d_ref",
    "multistep_update",
    "multistep_update_ref",
    "selective_state_update",
    "selective_state_update_ref",
    "conv_step",
    "conv_step_ref",
    "gated_rms_norm",
    "gated_rms_norm_ref",
    "replay",
    "replay_ref",
    "check_accepted",
    "tree_attention",
    "tree_attention_ref",
    "MAX_TREE_NODES",
]
