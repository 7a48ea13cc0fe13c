"""``nn.Linear`` whose CPU inference takes the fastest of four products, measured once per shape
on the machine it runs on.

A step, a tree pass and a drafter's level step multiply 1 to ~100 rows by each weight. Which
product is fastest for so few rows depends on the CPU far more than on the sizes: on an AMD EPYC
(AVX2) the BLAS path PyTorch takes (``x @ weight.T``) costs about one matrix-vector product per
row, where oneDNN on the weight packed once in its own layout is several times faster for a few
rows; on an Intel Xeon (AVX-512) BLAS on a transposed copy of the weight (``x @ weight_t``,
``[in, out]`` contiguous) was the fastest of those three for 1 to 32 rows, and PyTorch's own BLAS
path fell off a cliff at 16 rows (several times slower than at 12). The fourth, stree's own
register-tiled product (:mod:`stree.kernels.cpu.gemm`, built for the machine where a C++ compiler is
at hand), reads each weight once for up to 14 rows: on that Xeon a tree's 13 rows cost it little
more than one row, and MKL's products about twice that. So none is hard-wired: the first product of
each (rows, weight shape, bias) times the paths on its own inputs (alternating, best of 5 each,
the caches left as a pass leaves them: :func:`_evict`) and keeps the incumbent, the tiled product
where it is built here (else PyTorch's own), unless another is clearly faster (``MARGIN``). Inside
a decoding loop PyTorch's products cost far more than timed alone, the tiled one about what it did:
with PyTorch's own kept where the two were near a tie timed alone (a step's out_proj), a whole
step took a fifth to a third longer (the shipped target, eager batch 1 and compiled batch 2, on an
AMD EPYC), and the tie broke either way from process to process. So a path that beat the incumbent
timed alone is put on trial where it is used: the incumbent makes its next ``TRIAL`` products, the
challenger multiplying the same rows beside it, each timed inside the loop, and the challenger is
taken only if it is clearly faster there too (:class:`_Trial`; another AMD EPYC's transposed
copy, a fifth faster than the tiled product for a step's out_proj timed alone, made the whole step
an eighth slower, eager and compiled). Row counts share power-of-two buckets (:func:`_bucket`), so
that trees and prompts of every size do not each pay for a measurement. ``STREE_LINEAR=blas``, ``=packed``,
``=transposed`` or ``=tiled`` in the environment pins one (they agree to float32 rounding, so a
pinned path makes results bit-reproducible across processes).

Half precision (float16, bfloat16) has a two-way choice: PyTorch's own half product, or the
product of a float32 copy of the weight (on the float32 paths above), rounded back. The copy
holds the weight exactly, and both accumulate in float32 and round once, so they agree to half
rounding. Which wins again depends on the CPU and the rows: on an AMD EPYC without float16
arithmetic, a 16-row float16 product of 2.7B-width weights ran several times slower than the
float32 one, where one row, reading half the bytes, was the faster: a float16 tree pass cost
many plain steps there. So the incumbent is PyTorch's own for one row and, where the tiled product is
built, the float32 copy's for more: on an Intel Xeon with AMX and FP16 arithmetic, PyTorch's own half
product of two to a few dozen rows measured about level with the copy's timed alone and was
kept, while in decoding loops the copy's made batch-2 float16 decoding a fifth faster
(docs/benchmarks.md). ``STREE_LINEAR=blas`` pins PyTorch's own half product, ``=packed``,
``=transposed`` and ``=tiled`` the float32 copy.

The packed, transposed and tiled copies are made on first use and again whenever the weight changes
(its version counter or storage), so parameters may be trained or reloaded between calls; each costs
one more copy of the weight (the float32 copy of a half weight: twice its bytes), kept only while
some row count takes its path. Only where autograd is off (inference); the packed one on a build
with oneDNN. Under ``torch.compile`` the product is one opaque op (``stree::cpu_linear``) that
chooses when it runs, as Inductor does not take packed weights as graph inputs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import statistics
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels._common import kept, version
from ...kernels.cpu import gemm

__all__ = ["Linear", "following", "leading", "linear", "measure", "settle"]

PATHS = ("auto", "blas", "packed", "transposed", "tiled")
PATH = os.environ.get("STREE_LINEAR", "auto")
if PATH not in PATHS:
    raise ValueError(f"STREE_LINEAR must be one of {PATHS}, got {PATH!r}")
# Another product than the incumbent (_candidates) is taken only when it takes less than this fraction
# of its time: near a tie the incumbent is kept, so that noise does not flip the choice between processes.
MARGIN = 0.85

_ONEDNN = torch.backends.mkldnn.is_available()
# id(weight) -> ((version, storage address), packed copy); the entry goes with the weight
_PACKED: dict[int, tuple] = {}
# id(weight) -> ((version, storage address), the weight transposed, [in, out] contiguous)
_TRANSPOSED: dict[int, tuple] = {}
# id(weight) -> ((version, storage address), the weight packed in column blocks for the tiled product)
_TILED: dict[int, tuple] = {}
# (row bucket, out features, in features, has bias) -> the path measured fastest (a name in _PRODUCTS)
_FASTEST: dict[tuple, str] = {}
# the same keys -> each path's best time there, seconds (what following() weighs)
_TIMES: dict[tuple, dict[str, float]] = {}
# the same keys -> the _Trial of a path that beat the incumbent timed alone, until it ends; and the
# challengers that won theirs, taken at the next settle()
_TRIALS: dict[tuple, "_Trial"] = {}
_WON: dict[tuple, str] = {}
# Products of each of the two paths a trial times where they are used, before it judges them; and
# whether trials run (off, the choice timed alone stands from the first product: what counting a
# call's ops needs, tests/models/test_op_budgets.py, as a trial's products are made twice).
TRIAL = 8
TRIALS = True
HALF = (torch.float16, torch.bfloat16)
_DTYPES = (torch.float32, *HALF)  # what linear() multiplies itself
# id(half weight or bias) -> ((version, storage address), float32 copy); the entry goes with the tensor
_WIDE: dict[int, tuple] = {}
# (row bucket, out features, in features, has bias, dtype) -> the float32 copy's product is the faster here
_WIDER: dict[tuple, bool] = {}
# module -> (the tables, the row buckets) measure() has made sure of for it: a decoding call asks for the
# same rows every time, and walking the module's layers to find nothing missing cost a short call about
# a hundredth of its time. (A layer added to the module later measures its products on first use, as
# any product does; tables replaced, as tests do, are checked again.)
_MEASURED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
# A speculative loop's plain steps (in :func:`following`) take, for this many products of a
# weight, the path its last product in a tree pass (in :func:`leading`) took, then their own.
FOLLOW_WIDE = 8
_ROLE = contextvars.ContextVar("stree_linear_role", default=None)  # None, "lead" or "follow"
# id(weight) -> [the path of its last product in leading(), products in following() since]
_LAST: dict[int, list] = {}


@contextlib.contextmanager
def _role(role: str):
    token = _ROLE.set(role)
    try:
        yield
    finally:
        _ROLE.reset(token)


def leading():
    """A block of products (a speculative loop's tree pass) whose paths the products in
    :func:`following` take after it."""
    return _role("lead")


def following():
    """A block of products (a speculative loop's plain steps) that take, for ``FOLLOW_WIDE``
    products of a weight, the path its last product in :func:`leading` took: a step right after
    a tree pass then reads the copy of the weight that the pass left in the caches, where its own
    path's copy would be read from memory (on the CPU measured first: BLAS for a step's row, the
    packed copy for a tree's rows, and the step after each pass slower, speculation's gain some
    percent lower). Only a path that, timed alone for the step's rows, is not clearly slower than
    the step's own (``MARGIN``) is followed: with three paths a tree's could be one that costs a
    step's row several times its own (oneDNN's packed product of one or two rows on the Intel
    Xeon), and following it there cost the loop more than the caches gave back. Past those
    products a run of plain steps takes its own path again (the decoding loop then leaves this
    block out: a step multiplies each weight once, and the lookups here cost each product).
    Where every product measured so far takes one and the same path (on the AMD EPYC, the tiled
    product at every row count) and none is on trial (a trial times no product inside the block,
    where the caches are as a tree pass left them: :class:`_Trial`), no product would take another
    path, and the block is no block at all: its lookups had cost each step after a tree pass 1-3%
    of its time (the shipped target, eager, batch 2, in turns with the same work outside the
    block; docs/benchmarks.md). Autoregressive decoding and prefills enter neither block."""
    return _role("follow") if _TRIALS or len(set(_FASTEST.values())) > 1 else contextlib.nullcontext()


def _bucket(rows: int) -> int:
    """Row counts that share one measurement: 1, 2, then up to each power of two (3-4, 5-8, ...).
    Few enough that a decode loop whose tree sizes vary from step to step (trees cut to what was
    drafted, a drafter catching up on a few tokens or many) measures each within its first
    steps, not once per size inside the timing; fine enough to follow the CPUs seen so far, whose
    choice flips between ~5 and ~8 rows."""
    return rows if rows <= 2 else 1 << (rows - 1).bit_length()


def _copy(store: dict, tensor: torch.Tensor, make) -> torch.Tensor:
    """``make(tensor)``, kept in ``store`` until the tensor changes (its version counter or storage)
    or goes."""
    return kept(store, tensor, (version(tensor), tensor.data_ptr()), make)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return _copy(_PACKED, weight, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))


def wide(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A half tensor's float32 copy (exact), kept while the tensor is unchanged: the one its products'
    float32 path reads."""
    return None if tensor is None else _copy(_WIDE, tensor, lambda t: t.float())


def _packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")


def _transposed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w_t = _copy(_TRANSPOSED, weight, lambda w: w.t().contiguous())
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


def tiled_copy(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed for the tiled product (:func:`stree.kernels.cpu.gemm.pack`), one copy per
    value of the weight, shared by every product that reads it so."""
    return _copy(_TILED, weight, gemm.pack)


def _tiled_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # (x comes contiguous from linear(); the kernel reads a bias as contiguous memory)
    bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    return gemm.product_unchecked(x, tiled_copy(weight), weight.shape[0], bias)


# the float32 products by path, and the stores of the copies each keeps
_PRODUCTS = {"blas": F.linear, "transposed": _transposed_product}
if _ONEDNN:
    _PRODUCTS["packed"] = _packed_product
_PRODUCTS["tiled"] = _tiled_product
_COPIES = {"packed": _PACKED, "transposed": _TRANSPOSED, "tiled": _TILED}


def _candidates() -> dict:
    """The products a measurement weighs, the incumbent first (:func:`_fastest`): every one that
    can run here, the tiled one first where it can (it is built on the first measurement, where a
    compiler is at hand: :func:`stree.kernels.cpu.gemm.available`), else PyTorch's own."""
    others = {k: v for k, v in _PRODUCTS.items() if k != "tiled"}
    return {"tiled": _PRODUCTS["tiled"], **others} if gemm.available() else others


def _seconds(fn) -> float:
    """One call's wall time (a function of its own so that tests can stand in for the clock)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _l2_bytes() -> int:
    """One core's L2 cache (Linux's sysfs), else 2 MiB."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip().upper()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, IndexError):
        return 2 << 20


def _evict() -> None:
    """Leave the caches as a model's pass leaves them for a product: its weight pushed out of the
    L2 caches by the other layers' weights. Timed hot, on its own, a weight that fits in L2 took
    MKL's products for a few rows, which in a pass, reading the weight from L3, were the slower
    (docs/kernels.md). Four times each core's L2, written by every thread (torch splits the fill as
    a product splits its weight); kept for the process."""
    global _EVICTION
    if _EVICTION is None:  # (float32s: as many as each thread's L2 has bytes, four times its size)
        _EVICTION = torch.empty(_l2_bytes() * torch.get_num_threads())
    _EVICTION.fill_(1.0)


_EVICTION: torch.Tensor | None = None


def _fastest(paths: dict, best: dict | None = None) -> str:
    """The name of the fastest of ``paths`` (name -> call), the first being the incumbent, kept
    unless another takes less than ``MARGIN`` of its time: best of 5 each, alternating, each call
    after :func:`_evict`, after one call each (first calls allocate, pack and copy); ``best``,
    where given, gets each one's best."""
    for fn in paths.values():
        fn()
    times: dict = {name: [] for name in paths}
    for _ in range(5):
        for name, fn in paths.items():
            _evict()
            times[name].append(_seconds(fn))
    best = {} if best is None else best
    best.update((name, min(t)) for name, t in times.items())
    incumbent = next(iter(paths))
    other = min((name for name in paths if name != incumbent), key=best.__getitem__)
    return other if best[other] < MARGIN * best[incumbent] else incumbent


def _fastest_path(key: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The path measured fastest for ``key``; where that is not the incumbent, the incumbent, the
    other put on trial (:class:`_Trial`)."""
    paths = {name: functools.partial(fn, x, weight, bias) for name, fn in _candidates().items()}
    path = _fastest(paths, _TIMES.setdefault(key, {}))
    incumbent = next(iter(paths))
    if path != incumbent and TRIALS:
        _TRIALS[key] = _Trial(path, incumbent)
    for name, store in _COPIES.items():  # no copy of a weight for a path not taken (a bucket taking it copies again)
        if name != path and (key not in _TRIALS or name != incumbent):
            store.pop(id(weight), None)
    return incumbent if key in _TRIALS else path


class _Trial:
    """A path that beat the incumbent timed alone, tried where it is used: for ``TRIAL`` of its key's
    products the incumbent makes them and the challenger multiplies the same rows beside it, the two
    first in turns, each timed. A challenger whose median is under ``MARGIN`` of the incumbent's is
    taken at the next :func:`settle` (a decoding call's start), else its copies go. The results are
    the incumbent's until then, so a trial changes none inside a call (nor those of a model's own
    calls, which settle nothing): a step and the same step again stay equal to the last bit."""

    def __init__(self, challenger: str, incumbent: str):
        self.paths = (challenger, incumbent)
        self.times: tuple[list, list] = ([], [])

    def product(self, key: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        incumbent = _in_role(key, self.paths[1], weight)  # (a tree pass's leads the steps after it)
        for turn in ((0, 1) if len(self.times[0]) % 2 == 0 else (1, 0)):
            start = _clock()
            made = _PRODUCTS[incumbent if turn else self.paths[0]](x, weight, bias)
            self.times[turn].append(_clock() - start)
            if turn:
                out = made
        if len(self.times[0]) == TRIAL:
            del _TRIALS[key]
            if statistics.median(self.times[0]) < MARGIN * statistics.median(self.times[1]):
                _WON[key] = self.paths[0]
            else:
                _drop_unused(self.paths[0])
        return out


def settle() -> None:
    """Take the challengers that won their trials (:class:`_Trial`): called where a decoding call
    starts, so that no call's products change path midway."""
    for key, path in _WON.items():
        lost, _FASTEST[key] = _FASTEST.get(key), path
        _drop_unused(lost)
    _WON.clear()


def _drop_unused(path: str | None) -> None:
    """The weight copies of ``path`` where no row count takes it now (every layer of a shape on trial
    made both paths' copies; a path taken again copies its weights again)."""
    if path not in {*_FASTEST.values(), *_WON.values(), *(trial.paths[0] for trial in _TRIALS.values())}:
        _COPIES.get(path, {}).clear()


_clock = time.perf_counter  # (a trial's clock, which tests stand in for)


def _widened_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _product(x.float(), wide(weight), wide(bias)).to(x.dtype)


def _widened_is_faster(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # (the first widened call also measures the float32 product's own paths for the copy; the
    # incumbent, first: PyTorch's own for a row, the copy's for more where the tiled product is built)
    paths = {"own": lambda: F.linear(x, weight, bias), "wide": lambda: _widened_product(x, weight, bias)}
    if x.shape[0] > 1 and gemm.available():
        paths = {"wide": paths["wide"], "own": paths["own"]}
    faster = _fastest(paths) == "wide"
    if not faster:  # no float32 copy of a weight staying in half precision (its other copies go with it)
        for t in (weight, bias):
            _WIDE.pop(id(t), None)
    return faster


def _half_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A half-precision ``x @ weight.T + bias`` on the path chosen for this shape: PyTorch's own,
    or the float32 copy's (see the module docstring)."""
    if PATH == "auto":
        key = (_bucket(x.shape[0]), *weight.shape, bias is not None, x.dtype)
        widened = _WIDER.get(key)
        if widened is None:
            widened = _WIDER[key] = _widened_is_faster(x, weight, bias)
    else:
        widened = _pinned() != "blas"
    return _widened_product(x, weight, bias) if widened else F.linear(x, weight, bias)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] @ weight.T + bias`` on the path chosen for this shape (see the docstring)."""
    if x.dtype in HALF:
        return _half_product(x, weight, bias)
    if PATH == "auto":
        key = (_bucket(x.shape[0]), *weight.shape, bias is not None)
        path = _FASTEST.get(key)
        if path is None:  # (a trial starts at the next product)
            path = _FASTEST[key] = _fastest_path(key, x, weight, bias)
        elif _TRIALS and key in _TRIALS and _TRIALS[key].paths[1] == path and _ROLE.get() != "follow":
            return _TRIALS[key].product(key, x, weight, bias)  # (a table set since holds another path)
        path = _in_role(key, path, weight)
    else:
        path = _pinned()
    return _PRODUCTS[path](x, weight, bias)


def _pinned() -> str:
    """``STREE_LINEAR``'s path where it can run here, else PyTorch's own."""
    return "blas" if (PATH == "packed" and not _ONEDNN) or (PATH == "tiled" and not gemm.available()) else PATH


def _in_role(key: tuple, path: str, weight: torch.Tensor) -> str:
    """The path a product of ``key``'s rows takes in the block it is in (:func:`leading`,
    :func:`following`, or neither), ``path`` being its own; what a block keeps of it, kept."""
    role = _ROLE.get()
    if role is not None:
        last = _LAST.get(id(weight))
        if role == "follow":
            if last is not None and last[1] < FOLLOW_WIDE and _may_follow(key, last[0], path):
                last[1] += 1
                path = last[0]
        elif last is None:
            weakref.finalize(weight, _LAST.pop, id(weight), None)
            _LAST[id(weight)] = [path, 0]
        else:
            last[0], last[1] = path, 0
    return path


def _tiled_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The product of a contiguous ``x [..., in]`` of more than two dims (a tree pass's, a
    prompt's), its rows as they lie, where its row count takes the tiled path (float32, or a half
    ``x`` on the float32 copy's) outside a :func:`following` block; else None (measured, or
    another path: the caller's two-dim path). Without the reshapes to two dims and back, which
    cost a tree pass's product about as much as the tiled kernel's call."""
    rows = x.numel() // x.shape[-1]
    if x.dtype in HALF:
        widened = PATH != "blas" if PATH != "auto" else _WIDER.get((_bucket(rows), *weight.shape, bias is not None,
                                                                    x.dtype))
        out = _tiled_rows(x.float(), wide(weight), wide(bias)) if widened else None
        return None if out is None else out.to(x.dtype)
    key = (_bucket(rows), *weight.shape, bias is not None)
    if (_pinned() if PATH != "auto" else _FASTEST.get(key)) != "tiled" or _ROLE.get() == "follow" or key in _TRIALS:
        return None
    _in_role(key, "tiled", weight)
    return _tiled_product(x, weight, bias)


def _may_follow(key: tuple, lead: str, own: str) -> bool:
    """Whether a product of ``key``'s rows may take the path ``lead`` in place of its own ``own``
    (:func:`following`): where, timed alone, ``lead`` is not clearly slower (or was not timed)."""
    times = _TIMES.get(key, {})
    return lead not in times or own not in times or MARGIN * times[lead] <= times[own]


# Declared on the low-level library API: the dispatcher calls the CPU kernel directly, without
# custom_op's Python wrapper (measured at a third of a small product's time).
_LIB = torch.library.Library("stree", "DEF")
_LIB.define("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("cpu_linear", _product, "CPU")


@torch.library.register_fake("stree::cpu_linear", lib=_LIB)
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, on the faster product for these sizes (see the module docstring)."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    # (a pinned path that cannot run here is PyTorch's own, found inside the product: asked here, where
    # torch.compile traces, whether the tiled product is built broke a compiled step's graph at every product)
    if grad or not x.is_cpu or x.dtype not in _DTYPES or weight.dtype != x.dtype \
            or (bias is not None and bias.dtype != x.dtype) or not x.numel() or PATH == "blas":
        return F.linear(x, weight, bias)
    flat = x.dim() == 2 and x.is_contiguous()  # (a step's rows: no reshape and no view, two ops a product)
    if not flat and x.dim() > 2 and x.is_contiguous() and not torch.compiler.is_compiling():
        out = _tiled_rows(x, weight, bias)
        if out is not None:
            return out
    rows = x if flat else x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.stree.cpu_linear(rows, weight, bias) if torch.compiler.is_compiling() else \
        _product(rows, weight, bias)
    return out if flat else out.view(*x.shape[:-1], weight.shape[0])


def measure(module: nn.Module, rows) -> None:
    """Make now, for the weight shapes of ``module``'s :class:`Linear` layers and these row counts
    (their buckets), the choices :func:`linear` makes on its first product of each (timing its
    paths): a decoding loop names the rows its steps and tree passes may multiply, so that the
    timing is its setup, not a timed step's (a tree size first used mid-call, at batch 8, paid
    it there). Only where :func:`linear` chooses: CPU weights, ``STREE_LINEAR=auto``."""
    if PATH != "auto":
        return
    buckets = sorted({_bucket(r) for r in rows if r > 0})
    done = _MEASURED.get(module)
    if done is not None and done[0] is _FASTEST and done[1] is _WIDER and done[2].issuperset(buckets):
        return
    shapes = set()  # (layers of one shape share their choices)
    with torch.no_grad():
        for layer in module.modules():
            if not isinstance(layer, Linear) or layer.weight.device.type != "cpu":
                continue
            weight, bias = layer.weight, layer.bias
            half = weight.dtype in HALF
            shape = (*weight.shape, bias is not None, weight.dtype)
            if shape in shapes or (not half and weight.dtype != torch.float32):
                continue
            shapes.add(shape)
            for bucket in buckets:
                key = (bucket, *weight.shape, bias is not None) + ((weight.dtype,) if half else ())
                if key not in (_WIDER if half else _FASTEST):
                    _product(torch.randn(bucket, weight.shape[1], dtype=weight.dtype), weight, bias)
    fresh = done is None or done[0] is not _FASTEST or done[1] is not _WIDER
    _MEASURED[module] = (_FASTEST, _WIDER, frozenset(buckets) | (frozenset() if fresh else done[2]))


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) computing with :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (from the parameter dict: nn.Module's attribute lookup, twice, cost a step's product a
        # tenth; a weight or bias kept elsewhere, as a parametrization keeps it, is the attribute's)
        params = self._parameters
        if "weight" in params and "bias" in params:
            return linear(x, params["weight"], params["bias"])
        return linear(x, self.weight, self.bias)
