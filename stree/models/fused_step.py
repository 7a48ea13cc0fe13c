"""Where a model's decoding step, a prompt's prefill, a draft's tree pass and a greedy iteration run as one
call each (:class:`stree.kernels.cpu.mamba_step.MambaStep`):
a Mamba2 language model (every block a Mamba2 mixer behind an RMSNorm, no MLP, no µP scales, a
gated norm, x and B one head / group each), float32, float16 or bfloat16 (a half model's norms not
rounding before their weight) on the CPU, not tensor-parallel, where the
tiled product is built and the products are not pinned to another path (``STREE_LINEAR``); a step
outside autograd and ``torch.compile``, with the model's own kernels ("auto"), of int64 tokens, on a
cache whose states are contiguous, its conv states of the model's dtype, and whose lengths are int64 (a greedy iteration advances them in its
call). Anything else steps block by block, as before.

The layout is made once per value of the model's parameters (their versions and storages, and the
parameter objects the modules hold, are its key): a model trained or reloaded between steps gets a
new one. A decoding call looks it up once, as it begins (:class:`~stree.runtime.runners.EagerRunner`:
each lookup checks every parameter), and its steps then write into outputs of their own
(:meth:`~stree.kernels.cpu.mamba_step.MambaStep.reused`)."""

from __future__ import annotations

import operator
import statistics
import time

import numpy as np

import torch
from torch.nn.utils import parametrize

from ..kernels._common import as_numpy
from ..kernels.cpu import mamba_step
from ..kernels.cpu.tree_jit import JIT_MAX_NODES
from ..tree import TreeIndex, filled_mask
from .base import TreeLM
from .cache import ModelCache, SSMScratch
from .layers import linear
from .layers.mamba2 import Mamba2Mixer
from .layers.norms import GatedRMSNorm, RMSNorm

__all__ = ["fused_draft", "fused_prefill", "fused_step", "fused_tree", "fused_tree_greedy", "half_rows_of", "measure_half_rows"]

_VERSION = operator.attrgetter("_version")


def _holders(model) -> list | None:
    """Where the layout's tensors live, in order: (a module's parameter dict, the name) pairs (None:
    a block of another kind somewhere)."""
    head, norm_f = model.lm_head, model.final_norm
    if any(parametrize.is_parametrized(m) for m in (model.embed, norm_f, head)):
        return None
    out = [(model.embed._parameters, "weight"), (norm_f._parameters, "weight"), (head._parameters, "weight"),
           (head._parameters, "bias")]
    for blk in model.blocks:
        mixer = blk.mixer
        if (not isinstance(mixer, Mamba2Mixer) or type(blk.norm) is not RMSNorm
                or not isinstance(mixer.norm, GatedRMSNorm)):
            return None
        # (a parametrized parameter lives elsewhere, computed on each read: those step block by block)
        if any(parametrize.is_parametrized(m) for m in (blk.norm, mixer, mixer.in_proj, mixer.conv1d, mixer.norm,
                                                        mixer.out_proj)):
            return None
        own, conv, inp, outp = mixer._parameters, mixer.conv1d._parameters, mixer.in_proj._parameters, \
            mixer.out_proj._parameters
        out += [(blk.norm._parameters, "weight"), (inp, "weight"), (inp, "bias"), (conv, "weight"), (conv, "bias"),
                (own, "A_log"), (own, "D"), (own, "dt_bias"), (mixer.norm._parameters, "weight"), (outp, "weight"),
                (outp, "bias")]
    return out


def _eligible(model) -> bool:
    """The model's structure and settings (see the module docstring)."""
    half = model.dtype != torch.float32
    if (model.tp is not None or model.embed_scale != 1.0 or model.logits_scale != 1.0
            or model.dtype not in mamba_step.ROUNDING or model.device.type != "cpu" or not mamba_step.available()
            or model.lm_head.bias is not None
            or (half and any(norm.round_before_weight for norm in _norms(model)))):
        return False
    first = model.blocks[0]
    for blk in model.blocks:
        cfg = getattr(blk.mixer, "cfg", None)
        if (blk.mlp is not None or blk.parallel or (blk.in_scale, blk.out_scale, blk.mlp_scale) != (1.0, 1.0, 1.0)
                or cfg is None or cfg.proj_scales is not None or cfg.d_xb is not None or blk.mixer.norm.tp is not None
                or blk.mixer.norm.eps != first.mixer.norm.eps or blk.norm.eps != first.norm.eps):
            return False
    return True


def _norms(model) -> list:
    return [model.final_norm, *(n for blk in model.blocks for n in (blk.norm, blk.mixer.norm))]


def _wide(t: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter in float32: itself, or a half one's float32 copy (exact; a weight's the copy that the
    half products keep, :func:`~stree.models.layers.linear.wide`)."""
    return t if t is None or t.dtype == torch.float32 else linear.wide(t)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight packed for the tiled product: a float32 one's copy shared with the products that read it
    so, a half one's packed in its dtype (the one call's half packs, mamba_step.MambaLayer)."""
    return linear.tiled_copy(weight)


def _build(model) -> mamba_step.MambaStep | None:
    if not _eligible(model):
        return None
    half = model.dtype != torch.float32  # (its products' weights also packed in its dtype: mamba_step.MambaLayer)
    layers = []
    for blk in model.blocks:
        m = blk.mixer
        params = (blk.norm.weight, m.in_proj.weight, m.in_proj.bias, m.conv1d.weight, m.conv1d.bias, m.A(), m.D,
                  m.dt_bias, m.norm.weight, m.out_proj.weight, m.out_proj.bias)
        layers.append(mamba_step.MambaLayer(*map(_wide, params), _pack,
                                            half=None if not half else (m.in_proj.weight, m.out_proj.weight)))
    first = model.blocks[0].mixer
    cfg = first.cfg
    embed, final, head = map(_wide, (model.embed.weight, model.final_norm.weight, model.lm_head.weight))
    return mamba_step.MambaStep(layers, embed, final, head,
                                d_state=cfg.d_state, groups=cfg.ngroups, norm_group=first.norm.group_size,
                                gate_first=first.norm.gate_first, eps=model.blocks[0].norm.eps,
                                gnorm_eps=first.norm.eps, final_eps=model.final_norm.eps,
                                dt_limit=first.dt_limit(False), pack=_pack, dtype=model.dtype,
                                half_residual=not model.residual_fp32, head_half=model.lm_head.weight if half else None)


class _Plan:
    """A model's step (None: not one this takes) and what it was made from: the parameter objects
    where the modules held them, their versions and storages, the block list, the products' pin."""

    def __init__(self, model):
        self.blocks, self.path = model.blocks, linear.PATH
        self.holders = _holders(model)
        pairs = self.holders or ()
        self.dicts, self.names = [d for d, _ in pairs], [name for _, name in pairs]
        self.tensors = [] if self.holders is None else [d.get(name) for d, name in self.holders]
        present = [t for t in self.tensors if t is not None]
        self.versioned = [t for t in present if not t.is_inference()]  # (an inference tensor keeps no counter)
        self.present = present
        self.key = self._key()
        self.step = None if self.holders is None or self.path not in ("auto", "tiled") else _build(model)

    def _key(self) -> tuple:
        # (map over C getters: a step checks every parameter, and list comprehensions took half again)
        return list(map(_VERSION, self.versioned)), list(map(torch.Tensor.data_ptr, self.present))

    def holds(self, model) -> bool:
        if model.blocks is not self.blocks or linear.PATH != self.path or self.holders is None:
            return model.blocks is self.blocks and linear.PATH == self.path
        held = map(dict.get, self.dicts, self.names)
        return all(map(operator.is_, held, self.tensors)) and self._key() == self.key


def fused_step(model, cache: ModelCache, tokens: torch.Tensor | None, kernel_backend: str):
    """The model's step as one call (:class:`~stree.kernels.cpu.mamba_step.MambaStep`) for this cache
    and these tokens (None: int64 tokens to come), or None where it steps block by block (see the
    module docstring)."""
    if (kernel_backend != "auto" or torch.is_grad_enabled() or torch.compiler.is_compiling() or cache.conv is None
            or cache.k is not None or (tokens is not None and tokens.dtype != torch.int64)
            or cache.conv.dtype != model.dtype or not cache.conv.is_contiguous() or not cache.ssm.is_contiguous()
            or cache.seqlens.dtype != torch.int64 or not cache.seqlens.is_contiguous()):  # (iterations add to them)
        return None
    plan = model.__dict__.get("_stree_fused_step")
    if plan is None or not plan.holds(model):
        plan = model.__dict__["_stree_fused_step"] = _Plan(model)
    return plan.step


# (measure_half_rows) a tree of this many nodes is timed, this many times with each pack choice, after one
# warm-up each; the half packs are taken past HALF_ROWS where they are this much cheaper
HALF_ROWS_NODES, HALF_ROWS_ROUNDS, HALF_ROWS_MARGIN = 16, 8, 0.03


def measure_half_rows(model) -> int | None:
    """Where a half model's step is one call (:func:`fused_step`): whether the products of more than
    :data:`~stree.kernels.cpu.mamba_step.HALF_ROWS` rows take its half packs too, timed on this
    machine once per step made (each later call answers at once): a plain step, then a tree pass of
    ``HALF_ROWS_NODES`` nodes, in turns with each choice, as decoding has them (the float32 packs a
    big tree reads come cold after plain steps, and push the half packs out). The half packs for
    every row count where their medians are ``HALF_ROWS_MARGIN`` cheaper, else the default; the same
    sums either way. (A 16-node chain of the shipped float16 target took 3.35 plain steps against
    3.68 so on the 2-core Intel Xeon; on the 2-core Zen 4 the float32 packs were a tenth cheaper.)
    Returns the rows set, or None where there is no such call (a float32 model: no half packs)."""
    if not isinstance(model, TreeLM) or model.device.type != "cpu" or model.dtype == torch.float32:
        return None
    known = _measured_step(model)
    if known is not None:  # (asked at every decoding call's setup: no cache made to find the step again)
        return known.half_rows
    with torch.no_grad():
        cache = model.allocate_cache(1, HALF_ROWS_NODES + 2)
        step = fused_step(model, cache, None, model.kernel_backend)
        if step is None or step.head_h is None:
            return None
        if getattr(step, "half_rows_measured", False):
            return step.half_rows
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, step.vocab, (1, HALF_ROWS_NODES), generator=gen)
        parents = np.arange(-1, HALF_ROWS_NODES - 1, dtype=np.int64)  # (a chain)
        root = tokens[0, :1].contiguous()
        choices = (mamba_step.HALF_ROWS, 1 << 30)
        times: dict[int, list[float]] = {rows: [] for rows in choices}
        for turn in range(HALF_ROWS_ROUNDS + 1):
            for rows in choices if turn % 2 else choices[::-1]:
                step.half_rows = rows
                t0 = time.perf_counter()
                step(root, cache.conv, cache.ssm)
                step.tree(tokens, parents, cache.conv, cache.ssm)
                if turn:  # (the first: warm-up)
                    times[rows].append(time.perf_counter() - t0)
        default, half = (statistics.median(times[rows]) for rows in choices)
        step.half_rows = choices[1] if half < default * (1.0 - HALF_ROWS_MARGIN) else choices[0]
        step.half_rows_measured = True
        return step.half_rows


def half_rows_of(model) -> int | None:
    """The rows :func:`measure_half_rows` set on the model's step where they are not the default (None:
    the default, or no step measured): a cost profile measured with the other packs would price the
    passes of more rows wrongly, so the profiles' cache keeps them apart."""
    step = _measured_step(model)
    return None if step is None or step.half_rows == mamba_step.HALF_ROWS else step.half_rows


def _measured_step(model):
    """The model's step, where :func:`measure_half_rows` has measured it (else None)."""
    plan = model.__dict__.get("_stree_fused_step") if isinstance(model, TreeLM) else None
    step = None if plan is None else plan.step
    return step if getattr(step, "half_rows_measured", False) else None


def fused_prefill(model, cache: ModelCache, tokens: torch.Tensor, counts: torch.Tensor, kernel_backend: str):
    """Each row's first ``counts[r]`` of ``tokens`` ``[b, T]`` fed into the cache's states as one call
    (:meth:`~stree.kernels.cpu.mamba_step.MambaStep.prefill`, where the step is one call:
    :func:`fused_step`), the dt clamped as the model's prefills clamp it: the logits after each
    row's last token ``[b, V]`` (the cache's ``seqlens`` not advanced); or None."""
    step = fused_step(model, cache, tokens, kernel_backend)
    if step is None:
        return None
    counts = np.ascontiguousarray(counts.numpy(), dtype=np.int64)
    return step.prefill(tokens.contiguous(), counts, cache.conv, cache.ssm, model.blocks[0].mixer.dt_limit(True))


def fused_tree(model, cache: ModelCache, tokens: torch.Tensor, index, kernel_backend: str):
    """A tree pass of ``index`` (a draft's tree of at most ``JIT_MAX_NODES`` nodes, not packed) as
    one call, where the step is one (:func:`fused_step`): the logits and the pass's scratch, made as
    the layers' bound kernels make theirs (a commit replays it the same way); or None."""
    if not isinstance(index, TreeIndex) or index.n > JIT_MAX_NODES:
        return None
    step = fused_step(model, cache, tokens, kernel_backend)
    if step is None:
        return None
    parents = index.memo("parents_int64", lambda: np.ascontiguousarray(as_numpy(index.parents), dtype=np.int64))
    logits, arrays = step.tree(tokens.contiguous(), parents, cache.conv, cache.ssm)
    scratch = SSMScratch(*(torch.from_numpy(a) for a in arrays))
    scratch.arrays, scratch.kernels = arrays, list(step.layers)
    return logits, scratch


def fused_tree_greedy(model, cache: ModelCache, tree, index, max_depth: int, kernel_backend: str,
                      top_k: int | None = None, step: mamba_step.MambaStep | None = None):
    """A draft's tree pass, greedy verification and replay as one call
    (:meth:`~stree.kernels.cpu.mamba_step.MambaStep.tree_greedy`), where :func:`fused_tree` would
    take the pass: the logits at the paths' nodes (the head runs on the nodes the walks read; the
    rest unspecified), the accepted paths, their lengths, the bonus tokens, the emitted tokens, the
    rows' finiteness (of the logits their walks read) and, with ``top_k``, the target's laws along the
    paths (else None), the cache advanced (its states and ``seqlens``); or None. A draft with
    ``row_sizes`` has each row's own prefix scored alone (the nodes past a row's size not computed).
    ``step``: :func:`fused_step`'s for this cache and the tree's tokens, where the caller looked it up
    (else looked up here)."""
    if not isinstance(index, TreeIndex) or index.n > JIT_MAX_NODES:
        return None
    if step is None:
        step = fused_step(model, cache, tree.tokens, kernel_backend)
    if step is None:
        return None
    parents = index.memo("parents_int64", lambda: np.ascontiguousarray(as_numpy(index.parents), dtype=np.int64))
    valid = tree.arrays()[1]
    valid = filled_mask(*tree.tokens.shape, True) if valid is None else np.ascontiguousarray(valid)
    # (a packed draft's rows, each its own prefix: its nodes alone computed, the others' padding left out)
    sizes = None if tree.row_sizes is None else np.array(tree.row_sizes, dtype=np.int64)
    return step.tree_greedy(tree.tokens.contiguous(), parents, valid, max_depth, cache.conv, cache.ssm, top_k, sizes,
                            cache.seqlens)


def fused_draft(model, cache: ModelCache, tokens: torch.Tensor, counts: np.ndarray, parents: np.ndarray,
                nodes: ModelCache, head_ids: torch.Tensor | None, restore: np.ndarray | None,
                before: ModelCache | None, kernel_backend: str):
    """A drafter model's greedy draft as one call
    (:meth:`~stree.kernels.cpu.mamba_step.MambaStep.draft`), where the step is one call: the fed
    tokens' states in the cache (not its ``seqlens``), the nodes' in ``nodes`` (a cache of
    ``len(parents) * b`` rows), rows first restored from ``before``'s where ``restore`` says; the
    draft's tokens and the nodes' slots, or None."""
    step = fused_step(model, cache, tokens, kernel_backend)
    slots = [c for c in (nodes, before) if c is not None]
    # (the call reads the slots' conv states as the cache's dtype: a half model's of its dtype)
    if step is None or not all(c.conv.dtype == cache.conv.dtype and c.ssm.dtype == torch.float32 for c in slots) \
            or not all(t.is_contiguous() for c in slots for t in (c.conv, c.ssm)):
        return None
    head = None if head_ids is None else step.head_cut(head_ids)
    return step.draft(tokens.contiguous(), counts, parents, cache.conv, cache.ssm, nodes.conv, nodes.ssm, head,
                      restore, None if restore is None else (before.conv, before.ssm))
