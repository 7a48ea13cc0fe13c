"""Tree kernels for Mamba2 and the hybrids' attention layers: each has a Triton kernel and a
vectorised PyTorch path, ``*_torch`` (the CPU's production path; the references both are tested
against are the float64 definitions in :mod:`stree.testing`).

``backend="auto"`` runs Triton on CUDA tensors and the PyTorch path on CPU tensors, except the
decode step's two kernels, replay, small trees' conv and scan, and the norms, which run
numba-compiled on CPU tensors (:mod:`.step_jit`, :mod:`.replay_jit`, :mod:`.tree_jit`,
:mod:`.norm_jit`; half ones read through float32 copies, :func:`._common.readable`; a CPU float32
model's decoding pass calls them through :mod:`.cpu.bound`, bound to each layer's parameters); ``"torch"``
is the PyTorch path anywhere; ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` set before this
package is imported.
"""

from .conv_step import conv_step, conv_step_torch
from .gated_norm import gated_rms_norm, gated_rms_norm_torch, rms_norm
from .multistep import multistep_update, multistep_update_torch, selective_state_update, selective_state_update_torch
from .replay import check_accepted, replay, replay_torch
from .tree_attention import tree_attention, tree_attention_torch
from .tree_conv1d import tree_conv1d, tree_conv1d_torch
from .tree_scan import MAX_TREE_NODES, tree_scan, tree_scan_torch

__all__ = [
    "tree_scan",
    "tree_scan_torch",
    "tree_conv1d",
    "tree_conv1d_torch",
    "multistep_update",
    "multistep_update_torch",
    "selective_state_update",
    "selective_state_update_torch",
    "conv_step",
    "conv_step_torch",
    "gated_rms_norm",
    "gated_rms_norm_torch",
    "rms_norm",
    "replay",
    "replay_torch",
    "check_accepted",
    "tree_attention",
    "tree_attention_torch",
    "MAX_TREE_NODES",
]
