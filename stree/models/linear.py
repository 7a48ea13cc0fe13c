"""``nn.Linear`` whose float32 CPU inference on several rows runs on a weight prepacked for oneDNN.

A tree pass, a batched step and a drafter's level step multiply a handful of rows by each weight.
For 2-5 rows the BLAS path PyTorch takes costs about one matrix-vector product per row (the
shipped 4096 x 256 head: 0.11 ms for 1 row, 0.31 ms for 3, 0.37 ms for 13 on this project's CPU),
where oneDNN with the weight packed once in its own layout takes 0.09 ms for 3 rows and 0.22 ms
for 13. One row stays on ``F.linear`` (there oneDNN is no faster, and slower for small weights).

The packed copy is made on first use and again whenever the weight changes (its version counter
or storage), so parameters may be trained or reloaded between calls; it costs one more copy of
each weight so used. Only where autograd is off (inference), on a build with oneDNN. Under
``torch.compile`` the product is one opaque op (``stree::packed_linear``), as Inductor does not
take packed weights as graph inputs.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "linear"]

# id(weight) -> ((version, storage address), packed copy); the entry goes with the weight
_PACKED: dict[int, tuple] = {}
_ONEDNN = torch.backends.mkldnn.is_available()


def _packed(weight: torch.Tensor) -> torch.Tensor:
    key = (weight._version, weight.data_ptr())
    hit = _PACKED.get(id(weight))
    if hit is None or hit[0] != key:
        if hit is None:
            weakref.finalize(weight, _PACKED.pop, id(weight), None)
        hit = _PACKED[id(weight)] = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
    return hit[1]


def _run_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")


# Declared on the low-level library API: the dispatcher calls the CPU kernel directly, without
# custom_op's Python wrapper (~50 us a call, a third of a small product).
_LIB = torch.library.Library("stree", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("packed_linear", _run_packed, "CPU")


@torch.library.register_fake("stree::packed_linear", lib=_LIB)
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, on the packed weight where that is faster (see the module docstring)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if rows < 2 or grad or not _ONEDNN or x.device.type != "cpu" or x.dtype != torch.float32 \
            or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    if torch.compiler.is_compiling():
        out = torch.ops.stree.packed_linear(flat, weight, bias)
    else:
        out = _run_packed(flat, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) computing with :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
