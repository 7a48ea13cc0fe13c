"""A Mamba2 language model's whole decoding step in one call on the CPU (``mamba_step.cpp``, built
into the tiled product's library: :mod:`.gemm`).

Why: a step of a small model is bound by the host's work around its kernels, not by them. The
shipped 4-layer target's eager step spent about two thirds of its time between the kernels (module
calls, the products' choice, the parameters' and states' views, a dozen small tensors a layer),
each layer's kernels a few numba or ctypes calls of a few microseconds of work. Here the model's
parameters are laid out once (the products' weights packed as :func:`.gemm.pack` packs them) and a
step is one call: embedding, each block's RMSNorm, in_proj, conv, state update, gated norm,
out_proj and residual add, the final norm and the head. The norms and the state update are the numba
kernels' arithmetic (:mod:`.step_jit`, :mod:`.norm_jit`) operation by operation, the products the
tiled product's; the conv sums in float as the tree conv does and SiLU takes a polynomial exp that
vectorises (libm's, a call per element, had taken a 13-node pass's conv and gate most of their time).
Tests compare it with the model's own step (``tests/models/test_fused_step.py``).

What it takes: float32 parameters (a half model's widened; its products' weights also packed in its
dtype, which a product of up to eight rows reads at half the bytes) and SSM states on the CPU, conv states of
the model's dtype, x and B one head / group each (no repeats), D per head or per channel; the model side
decides where it applies (:mod:`stree.models.fused_step`). A half model (float16, bfloat16) computes in
float32 and rounds each output where its block-by-block path does, in every call alike (step, prefill,
pass, iteration, draft; a tree's scan, as in float32, sums in another order than a step's update).
"""

from __future__ import annotations

import copy
import functools
import struct

import numpy as np
import torch

from ...tree import host_tensor
from . import gemm
from .bound import aligned_array

__all__ = ["DRAFT_MAX_CHILDREN", "MambaLayer", "MambaStep", "available"]

_ARGS = struct.Struct("=16q")
_TREE_ARGS = struct.Struct("=14q")
_GREEDY_ARGS = struct.Struct("=27q")
_PREFILL_ARGS = struct.Struct("=8q2d1q")
_DRAFT_ARGS = struct.Struct("=21q")
MAX_GROUPS = 64  # (the tree scan's C . B per group is a fixed buffer in mamba_step.cpp)
DRAFT_MAX_CHILDREN = 64  # a draft's children of one node (mamba_step.cpp's top_entries keeps them in a buffer)
ROUNDING = {torch.float32: -1, torch.float16: 0, torch.bfloat16: 1}  # a model's dtype -> Sizes::rounding
# the products' rows up to which a half model's take its half packs (Sizes::half_rows), until measured where it
# runs (MambaStep.half_rows; stree.models.fused_step.measure_half_rows)
HALF_ROWS = 8
_HALF_ROWS_AT = 15  # (its word in the layout)


class MambaLayer:
    """One block's parameters, float32 CPU tensors: the block's RMSNorm weight ``[d_model]``,
    in_proj ``[d_in_proj, d_model]`` (+ bias), the conv ``[conv_dim, K]`` (+ bias), ``A`` (-exp of
    A_log), ``D``, ``dt_bias`` ``[heads]`` (D also ``[heads, headdim]``), the gated norm's weight
    ``[d_inner]``, out_proj ``[d_model, d_inner]`` (+ bias). ``pack``: what makes the products'
    packed weights (:func:`.gemm.pack`, or a store of them shared with other products). ``half``: a
    half model's in_proj and out_proj weights in its dtype (float16, bfloat16), packed so too: the
    products of up to eight rows read them (half the bytes), more rows the float32 ones."""

    FIELDS = ("norm_w", "in_w", "in_b", "conv_w", "conv_b", "A", "D", "dt_bias", "gnorm_w", "out_w", "out_b",
              "in_h", "out_h")

    def __init__(self, norm_w, in_w, in_b, conv_w, conv_b, A, D, dt_bias, gnorm_w, out_w, out_b, pack=gemm.pack,
                 half: tuple[torch.Tensor, torch.Tensor] | None = None):
        heads = A.shape[0]
        headdim = gnorm_w.shape[0] // heads
        kept = dict(norm_w=norm_w, in_b=in_b, conv_b=conv_b, A=A, dt_bias=dt_bias, gnorm_w=gnorm_w, out_b=out_b,
                    conv_w=conv_w.reshape(conv_w.shape[0], -1),
                    D=D[:, None].expand(heads, headdim) if D.dim() == 1 else D,
                    in_w=in_w, out_w=out_w)
        for name, t in kept.items():
            if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
                raise TypeError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        # (contiguous copies the layout owns, the C++ reading raw memory; the weights as packed)
        self.arrays = {k: None if t is None else t.detach().contiguous().clone() for k, t in kept.items()}
        self.arrays["in_w"], self.arrays["out_w"] = pack(in_w), pack(out_w)
        self.arrays["in_h"] = self.arrays["out_h"] = None
        self.half_dtype = None if half is None else half[0].dtype
        if half is not None:
            if (half[0].dtype not in (torch.float16, torch.bfloat16) or half[1].dtype != half[0].dtype
                    or half[0].shape != in_w.shape or half[1].shape != out_w.shape):
                raise TypeError(f"half must be in_proj's and out_proj's weights in one half dtype, got "
                                f"{[(t.dtype, tuple(t.shape)) for t in half]}")
            self.arrays["in_h"], self.arrays["out_h"] = pack(half[0]), pack(half[1])
        self.in_features, self.out_features = in_w.shape[1], out_w.shape[0]
        self.d_in_proj, self.d_inner = in_w.shape[0], out_w.shape[1]

    # What a commit replays a tree pass's scratch with (stree.kernels.cpu.bound.replay_arrays), as
    # arrays: made on the first commit, not with the layout (a step reads no array of its tensors).
    @functools.cached_property
    def A(self) -> np.ndarray:
        return self.arrays["A"].numpy()

    @functools.cached_property
    def dt_bias(self) -> np.ndarray:
        return self.arrays["dt_bias"].numpy()


class MambaStep:
    """The step of a model of ``layers`` (:class:`MambaLayer`), with ``embed`` ``[vocab, d_model]``,
    the final norm's weight and the (tied or own) head ``[vocab, d_model]`` (packed by ``pack``, as
    :class:`MambaLayer`'s); sizes: ``d_state``,
    ``groups`` (of B and C), ``norm_group`` (the gated norm's group), ``gate_first``; epsilons of the
    blocks' norms, the gated norms and the final norm; the dt clamp ``(lo, hi)`` of decoding.
    ``dtype``: the model's; a half model's (float16, bfloat16) parameters come widened to float32
    (exactly), its outputs round to its dtype where its block-by-block path rounds them (each norm's,
    product's, conv's and scan's; the residual stream's adds too where ``half_residual``), and the conv
    states it takes are of its dtype. ``head_half``: a half model's head in its dtype, packed so too for
    the products of up to eight rows, as its layers' ``half`` weights (given with them, or neither).
    :meth:`__call__` runs it on a cache's stacked states."""

    CUTS = 4  # the head's cuts kept (head_cut): a packed copy of its rows each

    def __init__(self, layers: list[MambaLayer], embed: torch.Tensor, final_w: torch.Tensor, head_w: torch.Tensor,
                 *, d_state: int, groups: int, norm_group: int, gate_first: bool, eps: float, gnorm_eps: float,
                 final_eps: float, dt_limit: tuple[float, float], pack=gemm.pack, dtype: torch.dtype = torch.float32,
                 half_residual: bool = False, head_half: torch.Tensor | None = None):
        lib = gemm.library()
        first = layers[0]
        d_model, vocab = embed.shape[1], head_w.shape[0]
        heads = first.arrays["A"].shape[0]
        headdim = first.d_inner // heads
        conv_dim, d_conv = first.arrays["conv_w"].shape
        if (conv_dim != heads * headdim + 2 * groups * d_state or first.d_in_proj != first.d_inner + conv_dim + heads
                or first.in_features != d_model or first.out_features != d_model or embed.shape[0] < vocab
                or first.d_inner % norm_group or groups > MAX_GROUPS):
            raise ValueError(f"the layers' sizes do not make a Mamba2 block of d_model {d_model}, {heads} heads of "
                             f"{headdim}, {groups} groups of d_state {d_state}")
        if dtype not in ROUNDING:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        halves = {layer.half_dtype for layer in layers} | {None if head_half is None else head_half.dtype}
        if halves not in ({None}, {dtype}) or dtype == torch.float32 and halves != {None} \
                or head_half is not None and head_half.shape != head_w.shape:
            raise TypeError(f"the layers' half weights and head_half must be of the model's half dtype {dtype} "
                            f"(all, or none), the head of the head's shape, got {sorted(map(str, halves))}")
        self.dtype = dtype
        self.embed = embed.detach().contiguous()
        self.final_w = final_w.detach().contiguous()
        self.head_w = pack(head_w)
        self.head_h = None if head_half is None else pack(head_half)
        self._head_src, self._pack, self._cuts = head_w.detach(), pack, {}
        self.layers = layers
        sizes = [len(layers), d_model, vocab, first.d_in_proj, first.d_inner, conv_dim, d_conv, heads, headdim,
                 d_state, groups, norm_group, int(gate_first), ROUNDING[dtype],
                 int(half_residual and dtype != torch.float32), HALF_ROWS]
        doubles = np.array([eps, gnorm_eps, final_eps, *dt_limit], dtype=np.float64).view(np.int64)
        words = sizes + doubles.tolist() + [t.data_ptr() for t in (self.embed, self.final_w, self.head_w)]
        words.append(0 if self.head_h is None else self.head_h.data_ptr())
        if len(words) != lib.stree_mamba_model_words():
            raise RuntimeError("mamba_step.cpp's model layout and this module's disagree")
        for layer in layers:
            row = [0 if layer.arrays[k] is None else layer.arrays[k].data_ptr() for k in MambaLayer.FIELDS]
            if len(row) != lib.stree_mamba_layer_words():
                raise RuntimeError("mamba_step.cpp's layer layout and this module's disagree")
            words += row
        self._layout = np.array(words, dtype=np.int64)
        self._at = self._layout.ctypes.data  # (its address, read once: an array's .ctypes costs microseconds)
        self._run, self._tree, self._greedy = lib.stree_mamba_step, lib.stree_mamba_tree, lib.stree_mamba_tree_greedy
        self._prefill, self._draft = lib.stree_mamba_prefill, lib.stree_mamba_draft
        self.vocab = vocab
        # the trailing shapes of a tree pass's scratch (xBC, x, dt, B; stree.models.cache.SSMScratch)
        self.tails = (conv_dim,), (heads, headdim), (heads,), (groups, d_state)
        self._kept: dict | None = None  # outputs reused from call to call, by shape (reused())

    @property
    def half_rows(self) -> int:
        """The rows up to which the products take the half packs (a half model's; more take the float32
        ones): the same sums either way, at another price. Set, it holds for this step and its
        :meth:`reused` twins (one layout)."""
        return int(self._layout[_HALF_ROWS_AT])

    @half_rows.setter
    def half_rows(self, rows: int) -> None:
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ValueError(f"half_rows must be an int >= 0, got {rows!r}")
        self._layout[_HALF_ROWS_AT] = rows

    def reused(self) -> "MambaStep":
        """This step, whose steps, greedy steps and greedy iterations write their logits (and a greedy
        step its choices, counts and flags) into outputs kept from call to call, one set per shape:
        each call overwrites what the last of its shape returned. For a decoding call's runner, which
        reads a step's outputs before the next: no allocation a step (a 13-node iteration's logits of
        the shipped target are 208 KiB, past the size glibc's malloc gives back to the system, so that
        each allocation had faulted its pages in anew)."""
        twin = copy.copy(self)
        twin._kept = {}
        return twin

    def _kept_or_made(self, key, make):
        """``make()``, or what it made the first time for ``key`` on a :meth:`reused` step."""
        if self._kept is None:
            return make()
        out = self._kept.get(key)
        if out is None:
            out = self._kept[key] = make()
        return out

    def _logits(self, *shape: int) -> torch.Tensor:
        """``torch.empty(*shape, vocab)``, or the one kept for that shape (:meth:`reused`)."""
        return self._kept_or_made(shape, lambda: torch.empty(*shape, self.vocab))

    def __call__(self, tokens: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                 heads: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[b, vocab]`` after ``tokens`` ``[b]`` (int64, contiguous), ``conv`` ``[layers,
        b, conv_dim, d_conv]`` and ``ssm`` ``[layers, b, heads, headdim, d_state]`` (contiguous,
        the conv states of the model's dtype, the SSM states float32: a cache's stacked states, advanced
        in place); ``heads`` ``[k]`` (int64,
        contiguous): those rows' logits alone, ``[k, vocab]``. The caller vouches for the shapes
        (a decoding step is checked by its model); token ids and ``heads`` are checked here,
        before anything is computed."""
        return self._step(tokens, conv, ssm, heads, 0)

    def greedy(self, tokens: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, top_k: int | None = None,
               lengths: torch.Tensor | None = None):
        """:meth:`__call__` for every row with each row's greedy choice made in the call: the logits
        ``[b, vocab]``, the choices ``[b, 1]`` (the first of equal maxima, as ``torch.argmax``; NaN
        never chosen but in the first entry), ones ``[b]`` (one token a row) and whether each row's
        logits are below +inf throughout (NaN not) ``[b]``, the last three host tensors of one
        array's memory (:func:`~stree.tree.host_tensor`); last, with ``top_k`` (cut to the
        vocabulary), the law a drafter learns from, as :meth:`tree_greedy`'s at a path's node: the
        softmax's ``top_k`` most likely ids ``[b, 1, top_k]`` and probabilities, and each choice's own
        ``[b, 1]`` (None without). ``lengths`` (int64 ``[b]``, contiguous, on the host: a cache's
        ``seqlens``), where given, is advanced by one a row in the call, with the states (a torch add
        after it had cost a plain step a tenth more in decoding, its code cold after the step's)."""
        b = tokens.shape[0]
        k = min(top_k or 0, self.vocab)
        at, *outputs, laws, addresses = self._kept_or_made(("greedy", b, k), lambda: self._step_outputs(b, k))
        return self._step(tokens, conv, ssm, None, at, k, addresses, lengths), *outputs, laws

    @staticmethod
    def _step_outputs(b: int, k: int) -> tuple:
        """:meth:`greedy`'s outputs for ``b`` rows and ``k`` laws: the address of one array holding the
        choices and counts (int64, the counts 1), then the flags; host tensors of them; the laws'
        tensors (None: ``k`` 0) and their addresses."""
        raw = np.empty(17 * b, dtype=np.uint8)
        ints = raw[:16 * b].view(np.int64)
        ints[b:] = 1
        laws = None if not k else (torch.empty(b, 1, k, dtype=torch.long), torch.empty(b, 1, k), torch.empty(b, 1))
        return (raw.ctypes.data, host_tensor(ints[:b].reshape(b, 1)), host_tensor(ints[b:]),
                host_tensor(raw[16 * b:].view(np.bool_)), laws,
                (0, 0, 0) if laws is None else tuple(t.data_ptr() for t in laws))

    def _step(self, tokens, conv, ssm, heads, at: int, laws: int = 0, addresses=(0, 0, 0),
              lengths: torch.Tensor | None = None) -> torch.Tensor:
        b = tokens.shape[0]
        k = b if heads is None else heads.shape[0]
        logits = self._logits(b) if heads is None else torch.empty(k, self.vocab)
        status = self._run(_ARGS.pack(self._at, tokens.data_ptr(), b, conv.data_ptr(), ssm.data_ptr(),
                                      0 if heads is None else heads.data_ptr(), k, logits.data_ptr(),
                                      torch.get_num_threads(), at, at + 16 * b if at else 0, laws, *addresses,
                                      0 if lengths is None else lengths.data_ptr()))
        if status > 0:
            raise ValueError(f"tokens must be in [0, {self.vocab}), got {int(tokens[status - 1])} at row {status - 1}")
        if status < 0:
            raise ValueError(f"heads must index the {b} rows, got {heads.tolist()}")
        return logits


    def prefill(self, tokens: torch.Tensor, counts: np.ndarray, conv: torch.Tensor, ssm: torch.Tensor,
                dt_limit: tuple[float, float]) -> torch.Tensor:
        """Feed each row ``counts[r]`` (int64 ``[b]``, in ``[1, T]``) of its ``tokens`` ``[b, T]`` (int64,
        contiguous) into ``conv`` and ``ssm`` (as :meth:`__call__`'s, advanced in place), the dt
        clamped to ``dt_limit`` (a prefill's: a model may clamp its prefills alone); returns the
        logits after each row's last token, ``[b, vocab]``. Exactly ``counts[r]`` steps' arithmetic
        (products over many rows at once: each entry sums in the same order). The caller vouches for
        the shapes and counts; token ids are checked here, before anything is computed."""
        b, T = tokens.shape
        logits = torch.empty(b, self.vocab)
        status = self._prefill(_PREFILL_ARGS.pack(self._at, tokens.data_ptr(), counts.ctypes.data, b, T,
                                                  conv.data_ptr(), ssm.data_ptr(), logits.data_ptr(),
                                                  float(dt_limit[0]), float(dt_limit[1]), torch.get_num_threads()))
        if status:
            row, at = divmod(status - 1, T)
            raise ValueError(f"tokens must be in [0, {self.vocab}), got {int(tokens[row, at])} at row {row}, "
                             f"position {at}")
        return logits

    def head_cut(self, ids: torch.Tensor) -> tuple:
        """The head cut to the tokens ``ids`` (int64, distinct, in the vocabulary; made once per
        ``ids`` tensor held, the last ``CUTS`` of them kept): what :meth:`draft` takes as ``head``."""
        cut = self._cuts.get(id(ids))
        if cut is None or cut[0] is not ids:
            keep = ids.detach().contiguous()
            if (keep.dim() != 1 or keep.dtype != torch.long or not len(keep) or int(keep.min()) < 0
                    or int(keep.max()) >= self.vocab or len(torch.unique(keep)) != len(keep)):
                raise ValueError(f"a head's cut must be distinct int64 token ids in [0, {self.vocab}), got "
                                 f"{keep.dtype} of shape {tuple(keep.shape)}")
            if len(self._cuts) >= self.CUTS:  # (a caller making new ids each time: the oldest cut goes)
                self._cuts.pop(next(iter(self._cuts)))
            cut = self._cuts[id(ids)] = (ids, self._pack(self._head_src[keep]), len(keep), keep)
        return cut[1:]

    def draft(self, tokens: torch.Tensor, counts: np.ndarray, parents: np.ndarray, conv: torch.Tensor,
              ssm: torch.Tensor, node_conv: torch.Tensor, node_ssm: torch.Tensor, head: tuple | None = None,
              restore: np.ndarray | None = None, before: tuple | None = None):
        """A greedy draft of the tree over ``parents`` (int64 ``[n]``, contiguous: -1, then each
        node's parent before it) for every row in one call: each row's first ``counts[r]`` (int64
        ``[b]``, in ``[1, T]``) of ``tokens`` ``[b, T]`` fed into ``conv`` and ``ssm`` (as
        :meth:`prefill`'s, with the step's dt clamp), then each node's children its most likely
        tokens in order (ties: the lower id; under ``head``, :meth:`head_cut`'s, among those ids
        alone, ties to the earlier), every node above the deepest level stepped from a copy of its
        parent's state into a slot of ``node_conv`` and ``node_ssm`` (``[layers, n * b, ...]``, as
        the states'; slot s of row r at s * b + r). First, with ``restore`` (int64 ``[b]``), row r's
        states are set to row ``restore[r]`` (where >= 0) of ``before``, an earlier draft's
        ``(node_conv, node_ssm)``. Returns the draft's tokens ``[b, n]`` (the root's 0: the
        caller's) and each node's slot ``[n]`` (-1: not stepped). The caller vouches for the shapes;
        the fed tokens, the tree and the rows restored are checked here, before anything is computed."""
        b, T = tokens.shape
        n = parents.shape[0]
        w, V, ids = (self.head_w, self.vocab, None) if head is None else head
        old = (0, 0, 0, 0) if restore is None else (restore.ctypes.data, before[0].data_ptr(), before[1].data_ptr(),
                                                   before[0].shape[1])
        out, slots = torch.zeros(b, n, dtype=torch.long), np.empty(n, dtype=np.int64)
        status = self._draft(_DRAFT_ARGS.pack(
            self._at, tokens.data_ptr(), counts.ctypes.data, b, T, parents.ctypes.data, n, conv.data_ptr(),
            ssm.data_ptr(), node_conv.data_ptr(), node_ssm.data_ptr(), w.data_ptr(), V,
            0 if ids is None else ids.data_ptr(), out.data_ptr(), slots.ctypes.data, torch.get_num_threads(), *old))
        if status > 0:
            row, at = divmod(status - 1, T)
            raise ValueError(f"tokens must be in [0, {self.vocab}), got {int(tokens[row, at])} at row {row}, "
                             f"position {at}")
        if status == -1:
            raise ValueError(f"parents must be -1, then each node's parent before it, got {parents.tolist()}; and "
                             f"the rows restored within the earlier draft's, got {restore}")
        if status == -2:
            raise ValueError(f"a node of the tree has more children than 64 or than the head's {V} rows")
        return out, slots

    def tree(self, tokens: torch.Tensor, parents: np.ndarray, conv: torch.Tensor, ssm: torch.Tensor):
        """A tree pass: logits ``[b, n, vocab]`` at every node of the trees over ``parents`` ``[rows,
        n]`` (int64, contiguous, rows 1 or b, parents before children) with ``tokens`` ``[b, n]``
        (int64, contiguous), the states only read; and what replay reads, (xBC, x, dt, B) as float32
        arrays ``[layers, b, n, ...]`` (:attr:`tails`). The caller vouches for the shapes and the
        tree (a model checks them); token ids are checked here."""
        b, n = tokens.shape
        scratch = tuple(aligned_array((len(self.layers), b, n, *tail)) for tail in self.tails)
        logits = torch.empty(b, n, self.vocab)
        status = self._tree(_TREE_ARGS.pack(
            self._at, tokens.data_ptr(), b, n, parents.ctypes.data, parents.shape[0], conv.data_ptr(),
            ssm.data_ptr(), *(a.ctypes.data for a in scratch), logits.data_ptr(), torch.get_num_threads()))
        if status:
            row, node = divmod(status - 1, n)
            raise ValueError(f"tokens must be in [0, {self.vocab}), got {int(tokens[row, node])} at row {row}, "
                             f"node {node}")
        return logits, scratch

    def tree_greedy(self, tokens: torch.Tensor, parents: np.ndarray, valid: np.ndarray, max_depth: int,
                    conv: torch.Tensor, ssm: torch.Tensor, top_k: int | None = None, sizes: np.ndarray | None = None,
                    lengths: torch.Tensor | None = None):
        """A greedy iteration in one call: :meth:`tree`'s pass, greedy verification of its logits (``valid`` ``[b,
        n]`` bool: the nodes a path may take; ``max_depth``: the trees'), and the accepted paths' replay into
        ``conv`` and ``ssm``, advanced in place. The head (final norm and product) runs on the nodes the walks
        read, a wave at a time (each waiting walk's chain of first children, topped up to a few rows), not on
        every node: a walk reads its path alone, and the head's product was the pass's largest per node. Returns
        the logits ``[b, n, vocab]``, those of each row's path nodes alone made (the rest unspecified), and, as
        arrays, each row's path ``[b, max_depth + 1]`` (root first, 0 past it), its length, the bonus, the
        emitted tokens (the accepted drafts, then the bonus; the root's token past them) ``[b, max_depth + 1]``
        and whether every logit the row's walk read is below +inf (NaN not: NaN or +inf at a node no walk
        reaches is never made, and plain decoding would not feed its token); with ``top_k`` (cut to the
        vocabulary), also the laws a drafter learns from at each row's path nodes (None without): the softmax's
        ``top_k`` most likely ids ``[b, max_depth + 1, top_k]`` and probabilities, and each emitted token's own
        ``[b, max_depth + 1]`` (0 past a row's count; the softmax's exp a polynomial's, within float32 rounding
        of ``torch.softmax``). Token ids are checked before anything is computed; the rest is the caller's to
        vouch for, as :meth:`tree`'s. ``sizes`` (int64 ``[b]``, each in [1, n]): row r's tree is its first
        ``sizes[r]`` nodes (a packed draft's ``row_sizes``), the nodes past them neither computed nor walked;
        the pass then costs what its rows' nodes in all do (None: every row all n). ``lengths`` (int64 ``[b]``,
        contiguous, on the host: a cache's ``seqlens``), where given, is advanced by each row's path length in
        the call, with the states. The path, length, bonus, emitted tokens and flags are host tensors
        (:func:`~stree.tree.host_tensor`) of one array's memory; a :meth:`reused` step keeps them, the logits
        and the laws per shape, as its greedy steps do."""
        b, n = tokens.shape
        L = max_depth + 1
        logits = self._logits(b, n)
        k = min(top_k or 0, self.vocab)
        at, outputs, laws, addresses = self._kept_or_made(("tree", b, L, k), lambda: self._iteration_outputs(b, L, k))
        status = self._greedy(_GREEDY_ARGS.pack(
            self._at, tokens.data_ptr(), b, n, parents.ctypes.data, parents.shape[0], conv.data_ptr(),
            ssm.data_ptr(), 0, 0, 0, 0, logits.data_ptr(), torch.get_num_threads(), valid.ctypes.data, L,
            at, at + 8 * 2 * b * L, at + 8 * b * L, at + 8 * (2 * b * L + b), at + 16 * b * (L + 1), k,
            *addresses, 0 if sizes is None else sizes.ctypes.data, 0 if lengths is None else lengths.data_ptr()))
        if status > 0:
            row, node = divmod(status - 1, n)
            raise ValueError(f"tokens must be in [0, {self.vocab}), got {int(tokens[row, node])} at row {row}, "
                             f"node {node}")
        if status < 0:
            raise ValueError(f"a path runs deeper than max_depth {max_depth}")
        return logits, *outputs, laws

    @staticmethod
    def _iteration_outputs(b: int, L: int, k: int) -> tuple:
        """:meth:`tree_greedy`'s outputs for ``b`` rows, paths of ``L`` and ``k`` laws: path, emitted,
        num, bonus (int64) and finite (bool) in one array, its address, and host tensors of them (each
        array's own ``.ctypes`` and tensor took microseconds a call where a pass has just swept the
        caches); the laws' tensors (None: ``k`` 0) and their addresses."""
        m = 2 * b * (L + 1)
        raw = np.empty(8 * m + b, dtype=np.uint8)
        ints, finite = raw[:8 * m].view(np.int64), raw[8 * m:].view(np.bool_)
        path, emitted = ints[:b * L].reshape(b, L), ints[b * L:2 * b * L].reshape(b, L)
        num, bonus = ints[2 * b * L:2 * b * L + b], ints[2 * b * L + b:]
        laws = None if not k else (torch.empty(b, L, k, dtype=torch.long), torch.empty(b, L, k), torch.empty(b, L))
        return (raw.ctypes.data, tuple(map(host_tensor, (path, num, bonus, emitted, finite))), laws,
                (0, 0, 0) if laws is None else tuple(t.data_ptr() for t in laws))


def available() -> bool:
    """Whether the step's library is built here (the tiled product's: :func:`.gemm.available`)."""
    return gemm.available()
