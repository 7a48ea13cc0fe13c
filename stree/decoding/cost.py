"""What decoding costs on the machine at hand, measured there: one autoregressive iteration, and
one speculative iteration (drafting included) as a function of the tree's node count.

Nothing in a tree's worth can be judged without it: on a GPU a 64-node tree pass costs about one
step, on a 2-core CPU several (paper 001 §4; Sequoia's hardware-aware optimiser picks its tree
sizes from the same measurement). :func:`cost_profile` measures a model with a drafter at a batch
size and in a decoding mode (eager, compiled, CUDA graphs) by running the loop's own work on a
random context: the drafter's ``propose`` and ``observe`` and the step functions of
:mod:`stree.decoding.steps`, the sizes taking turns, warm-up excluded, in about ``budget_s`` seconds
(default ``$STREE_COST_SECONDS``, else 2: fewer rounds give noisier medians, not other work; the
test suite, which decodes a hundred models and never reads their timings, sets it low).
Drafting and the target's pass are timed together because they are not independent: a drafter
model's weights push the target's out of the CPU's caches (a tree pass after a drafter's steps
costs more than one after another pass). The result is kept for the process and in a small JSON file (``$STREE_CACHE_DIR``, else
``$XDG_CACHE_HOME/stree``, else ``~/.cache/stree``), keyed by everything the times depend on: the
model's class and config, the drafter's kind (and its model's config), dtype, device (the CPU's
model and thread count, or the GPU's name), batch size, mode, sizes, the library's and torch's
versions and a digest of the library's sources. A file that is corrupt, or whose entry was made
for another key, is measured again and rewritten, never trusted and never fatal; written, it keeps
the newest ``KEEP_OTHERS`` entries of other sources (see :func:`_pruned`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import statistics
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checkpoints.atomic import write_text
from ..kernels._common import cache_dir
from ..models.fused_step import half_rows_of

__all__ = ["CostProfile", "bracketed_profile", "cache_file", "cost_profile", "model_step_ms", "MODES"]

MODES = ("eager", "compiled", "cuda_graph")
CATCH = 64  # tokens of context a drafter model's catch-up is timed on
FORMAT = 15  # of the cache file; another is re-measured (15: wakes fitted over the sizes, costs non-decreasing)
# The least share of a plain step's iteration a tree's may take: a tree pass does a step's work and
# more, so a profile below it was measured while something else took the cores (CostProfile.plausible).
# (Not against smaller trees: on a GPU, where a small model's iterations are bound by the host, larger
# trees were measured up to a quarter below smaller ones, by jitter.)
SLACK = 0.8
# How far a cached profile's iteration (in steps) may be from a spot check's before it is measured again
# (cost_profile's check): spot checks of a few rounds scatter by about a tenth around the full measurement.
AGREE = 1.25
# How much slower than a spot check's a cached profile's plain step may be before it is measured again
# (decoding's own plain steps have a factor of their own: AutoTree.FORGET). Iterations in steps agree
# however busy the cores were, where the whole machine slowed alike: profiles measured beside other
# work, at 1.6 to 4.8 times the plain step's time, passed the check, and an adaptive choice that
# followed the clock still ran compiled STAND at batch 2 at 0.70-0.80 of plain decoding's pace
# (docs/benchmarks.md). Only a slower cached profile: where the spot check is the slower, the cores
# are busy now, and a profile measured now would be the wrong one.
STALE = 1.5


@dataclass(frozen=True)
class CostProfile:
    """Milliseconds of one decoding iteration for a model (and drafter), batch size and mode:
    ``step_ms`` for an autoregressive one (step, sampling, the host transfer; past ``WAKE`` plain
    steps in a row), and for a speculative one over a tree of ``nodes[i]`` nodes ``tree_ms[i]`` (tree
    pass, verification, commit, the host transfer, and what the ``WAKE`` plain steps after it take
    beyond ``step_ms``) after ``draft_ms[i]`` of drafting. ``catch_ms``: what a drafter
    model takes per token it has to read before drafting (after plain steps, or a new context's
    prefill); 0 for drafters without a model. ``depths``: for a drafter model, which runs one
    step per tree level, each measured tree's depth: its drafting then grows with the depth more
    than with the nodes (a 16-node chain measured about twice a 6-deep 16-node tree), and is
    fitted as a + b depth + c nodes (:meth:`drafting_ms`)."""

    step_ms: float
    nodes: tuple[int, ...]
    tree_ms: tuple[float, ...]
    draft_ms: tuple[float, ...] = ()
    catch_ms: float = 0.0
    depths: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.draft_ms:
            object.__setattr__(self, "draft_ms", (0.0,) * len(self.nodes))
        ok = (math.isfinite(self.step_ms) and self.step_ms > 0 and len(self.nodes) == len(self.tree_ms)
              == len(self.draft_ms) and all(a < b for a, b in zip(self.nodes, self.nodes[1:]))
              and all(n >= 2 for n in self.nodes) and all(math.isfinite(t) and t > 0 for t in self.tree_ms)
              and all(math.isfinite(t) and t >= 0 for t in self.draft_ms)
              and math.isfinite(self.catch_ms) and self.catch_ms >= 0
              and (not self.depths or (len(self.depths) == len(self.nodes)
                                       and all(1 <= d < n for d, n in zip(self.depths, self.nodes)))))
        if not ok:
            raise ValueError(f"not a cost profile: step_ms={self.step_ms!r}, nodes={self.nodes!r}, "
                             f"tree_ms={self.tree_ms!r}, draft_ms={self.draft_ms!r}, catch_ms={self.catch_ms!r}, "
                             f"depths={self.depths!r}")

    @property
    def plausible(self) -> bool:
        """Whether every tree's iteration takes at least ``SLACK`` of a plain step's. One that does
        not was measured beside other work: timed again, and never written to the cache file, where
        every later process would trust it."""
        return all(t >= SLACK * self.step_ms for t in self.tree_ms)

    def iteration_ms(self, n: int) -> float:
        """The target's part of an iteration over a tree of ``n`` nodes (1: an autoregressive
        step): linear between the measured sizes, the first size's below it, the last segment's
        slope past the last."""
        if n <= 1 or not self.nodes:
            return self.step_ms
        return _interpolate(self.nodes, self.tree_ms, n)

    def drafting_ms(self, n: int, depth: int | None = None) -> float:
        """Drafting a tree of ``n`` nodes (interpolated likewise), or, for a drafter model, of
        ``n`` nodes and ``depth`` levels (default: as deep as the measured tree of its size)."""
        if n <= 1 or not self.nodes:
            return 0.0
        if not self.depths or depth is None:
            return _interpolate(self.nodes, self.draft_ms, n)
        a, b, c = self.draft_fit
        return a + b * depth + c * n

    @functools.cached_property
    def draft_fit(self) -> tuple[float, float, float]:
        """Least squares a + b depth + c nodes over the measured trees, every coefficient >= 0
        (one that comes out negative is left out and the rest fitted again)."""
        ms = np.asarray(self.draft_ms)
        columns = {0: np.ones(len(ms)), 1: np.asarray(self.depths, float), 2: np.asarray(self.nodes, float)}
        used = [0, 1, 2]
        while True:
            coef = np.linalg.lstsq(np.stack([columns[i] for i in used], 1), ms, rcond=None)[0]
            if len(used) == 1 or (coef >= 0).all():
                break
            used.pop(1 + int(np.argmin(coef[1:])) if (coef[1:] < 0).any() else 0)
        fit = [0.0, 0.0, 0.0]
        for i, v in zip(used, coef):
            fit[i] = max(float(v), 0.0)
        return fit[0], fit[1], fit[2]

    def in_steps(self, n: int) -> float:
        """A whole iteration of ``n`` nodes, drafting included, in autoregressive steps."""
        return (self.iteration_ms(n) + self.drafting_ms(n)) / self.step_ms

    def between(self, other: "CostProfile", w: float) -> "CostProfile":
        """The profile a fraction ``w`` of the way from this one to ``other`` (another batch size
        of the same model, drafter and mode): every time linear in ``w``, over the tree sizes both
        measured."""
        mix = lambda a, b: (1 - w) * a + w * b
        theirs = {n: (t, d) for n, t, d in zip(other.nodes, other.tree_ms, other.draft_ms)}
        common = [i for i, n in enumerate(self.nodes) if n in theirs]
        return CostProfile(mix(self.step_ms, other.step_ms), tuple(self.nodes[i] for i in common),
                           tuple(mix(self.tree_ms[i], theirs[self.nodes[i]][0]) for i in common),
                           tuple(mix(self.draft_ms[i], theirs[self.nodes[i]][1]) for i in common),
                           mix(self.catch_ms, other.catch_ms),
                           tuple(self.depths[i] for i in common) if self.depths else ())

    def to_dict(self) -> dict:
        return dict(step_ms=self.step_ms, nodes=list(self.nodes), tree_ms=list(self.tree_ms),
                    draft_ms=list(self.draft_ms), catch_ms=self.catch_ms, depths=list(self.depths))

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        return cls(float(d["step_ms"]), tuple(int(n) for n in d["nodes"]), tuple(float(t) for t in d["tree_ms"]),
                   tuple(float(t) for t in d["draft_ms"]), float(d["catch_ms"]), tuple(int(k) for k in d["depths"]))


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string: timings on the CPU
    differ several-fold between CPU models, so a result names the one it ran on. Read once (every
    decoding call's cost-profile key names it; reading the file took a tenth of a call's setup)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _interpolate(xs, ys, x: float) -> float:
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), min(y0, y1))


def default_sizes(device: torch.device) -> tuple[int, ...]:
    """Tree sizes to measure: up to 64 nodes on the CPU (where a pass grows about linearly past a
    few nodes), 256 on a GPU (where a pass stays near a step's cost far longer). On the CPU every
    size up to 8 and every other to 16, where a pass's cost turns from level to climbing (its
    products read each weight once for a tile of rows, :mod:`stree.kernels.cpu.gemm`): on the
    2-core Intel Xeon with AMX level to about ten rows (batch 1 to 8 nodes, batch 2 to 5), then
    about linear. Timed at powers of two alone, the few sizes there each moved the choice by their
    own noise (two profiles at batch 2 put 4 nodes at 1.27 and 1.91 steps, 8 nodes at 1.57 and
    1.68); timed densely, the choice's batch-2 n-gram decoding gained 0.04 over plain decoding's
    pace, paired in eight processes (docs/benchmarks.md)."""
    if device.type != "cpu":
        return tuple(2 ** k for k in range(1, 9))
    return (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 24, 32, 48, 64)


# ---- the cache -------------------------------------------------------------------------------
# what this process measured or read, by the file's key; and cost_profile's answers by what that key
# is made of (the model's class and config, dtype, device and threads, the arguments; the rest is the
# process's): a decoding call asks for its profile once, and making the file's key (a JSON text and
# its digest) each time had taken a third of what a call of 16 tokens spent setting up its choice
# beyond plain decoding, its caches cold from decoding
_MEMO: dict[object, object] = {}


def cache_file() -> Path:
    return cache_dir() / "costs.json"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}"
    return f"cpu {cpu_model()} x{torch.get_num_threads()} threads"


@functools.lru_cache(maxsize=4)
def source_digest(root: Path | None = None) -> str:
    """A digest of the Python and C++ sources under ``root`` (default: the library's own), names
    and contents. A development install keeps its version string through changes that move what a
    tree costs (a kernel taking another path), and a profile measured before such a change must
    not price trees after it."""
    root = Path(__file__).resolve().parents[1] if root is None else root
    digest = hashlib.sha256()
    for path in sorted(p for pattern in ("*.py", "*.cpp") for p in root.rglob(pattern)):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _key(kind: str, model, **fields) -> tuple[str, dict]:
    from .. import __version__

    what = dict(kind=kind, model=type(model).__name__, config=repr(getattr(model, "cfg", None)),
                dtype=str(model.dtype), device=device_name(model.device), stree=__version__, code=source_digest(),
                torch=torch.__version__, format=FORMAT, **fields)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32], what


def _read(key: str) -> dict | None:
    """The cached entry under ``key`` if the file holds a well-formed one made for that key."""
    try:
        data = json.loads(cache_file().read_text())
        entry = data["entries"][key]
        return entry if data.get("format") == FORMAT and entry.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write(key: str, entry: dict) -> None:
    """Add ``entry`` to the cache file (rewritten whole; an unreadable one is replaced). A file
    that cannot be written leaves the result in this process only."""
    path = cache_file()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError
    except (OSError, ValueError):
        data = dict(format=FORMAT, entries={})
    data["entries"][key] = dict(entry, key=key)
    _store(dict(data, entries=_pruned(data["entries"])))


# Entries made by other library sources (their keys hold the sources' digest: this installation never
# reads them again) that the file keeps, the newest: another installation sharing the directory keeps
# its own, while every edit of a development install had left its profiles behind for good (722
# entries, 1.5 MB, after two days of one machine's benchmarks, which each process's first look-up of a
# profile read whole: docs/benchmarks.md).
KEEP_OTHERS = 64


def _pruned(entries: dict) -> dict:
    """``entries`` less those made by other sources beyond the newest ``KEEP_OTHERS`` of them."""
    code = source_digest()
    made = {k: e["made"] if isinstance(e, dict) and isinstance(e.get("made"), dict) else {} for k, e in entries.items()}
    others = sorted((str(m.get("date", "")), k) for k, m in made.items() if m.get("code") != code)
    gone = {k for _, k in others[: max(len(others) - KEEP_OTHERS, 0)]}
    return {k: e for k, e in entries.items() if k not in gone}


def _store(data: dict) -> None:
    """``data`` as the cache file; where it cannot be written, nothing (the process keeps what it has)."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(data, indent=1))
    except OSError:
        pass


def _cached(kind: str, model, parse, measure, fields: dict, refresh: bool, keep=None, holds=None):
    """The value for ``fields``: this process's, else the file's (where ``keep(value)`` holds, and
    ``holds(value)``: whether it still describes the machine), else ``measure()`` (written to the
    file where ``keep(value)`` holds)."""
    key, what = _key(kind, model, **fields)
    if not refresh:
        hit = _MEMO.get(key)
        if hit is not None:
            return hit
        entry = _read(key)
        value = None
        if entry is not None:
            try:
                value = parse(entry["value"])
            except (KeyError, TypeError, ValueError):
                pass  # a malformed entry: measured again below
        if value is not None and (keep is None or keep(value)) and (holds is None or holds(value)):
            _MEMO[key] = value
            return value
    value = measure()
    _MEMO[key] = value
    if keep is None or keep(value):
        _write(key, dict(value=value.to_dict(), made=dict(what, date=time.strftime("%Y-%m-%dT%H:%M:%S"))))
    return value


# ---- measuring ------------------------------------------------------------------------------
def cost_profile(model, batch_size: int, *, drafter=None, mode: str = "eager", sampled: bool = False, shapes=None,
                 budget_s: float | None = None, refresh: bool = False, check: bool = False,
                 scan: str = "tree") -> CostProfile:
    """The :class:`CostProfile` of ``model`` with ``drafter`` (None: the target's work alone) at
    ``batch_size`` rows in ``mode``, greedy or ``sampled`` (drawing and the lossless rejection
    rules cost more than argmax), cached (see the module docstring). ``shapes``: the tree
    shapes to time, one per size (default: full binary trees cut to :func:`default_sizes`);
    compiled and graphed modes build (and keep) each shape's pass. The drafter is left reset,
    its random stream as it was. ``refresh``: measure again whatever is cached. A profile that is
    not :attr:`~CostProfile.plausible` is measured once more, and is not written to the file.
    ``check``: where the profile comes from the file (another process measured it), time two of
    its sizes again first, in an eighth of the budget, and measure it all again where either's
    iteration in steps is off by more than ``AGREE`` either way (:func:`agrees`): a profile
    measured while something else took the cores had priced trees up to a third too high for
    good, and speculation then ran where it lost. Eager only (a compiled or graphed spot check
    would compile its calls again); :func:`~stree.decoding.autotree.auto_tree` asks for it where
    the choice follows the clock (a seeded choice's trees, and so its output, follow the file). A
    profile measured here is spot-checked the same way, right after, and measured once more where
    it is off: a burst of other work during some sizes' rounds (the end of a test run) had priced
    16 nodes at 3.4 steps against 1.8, and the n-gram drafter's gain fell by a fifth in that
    process. ``scan``: how the loop verifies the trees ("chain": ``method="chain"``'s multi-step
    update, whose CPU path is the PyTorch reference: priced by the tree scan's passes, a chain
    choice's iterations took three times what it expected, docs/decoding.md)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if scan not in ("tree", "chain"):
        raise ValueError(f"scan must be 'tree' or 'chain', got {scan!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if shapes is None:
        shapes = [_binary(n) for n in default_sizes(model.device)]
    sizes = sorted(s.n for s in shapes)
    fields = dict(batch=batch_size, mode=mode, sizes=sizes, drafter=drafter_kind(drafter),
                  sampled=bool(sampled), **({} if scan == "tree" else dict(scan=scan)))  # (tree: the older keys)
    packs = half_rows_of(model)
    if packs is not None:  # (the products' packs measured other than the default: their passes cost otherwise)
        fields["half_rows"] = packs
    checked = check and mode == "eager"
    asked = ("profile", type(model).__name__, _config_text(model), str(model.dtype), str(model.device),
             torch.get_num_threads(), repr(sorted(fields.items())))
    if not refresh and asked in _MEMO:
        return _MEMO[asked]
    if budget_s is None:
        budget_s = default_budget()
    shapes = sorted(shapes, key=lambda s: s.n)

    def holds(cached: CostProfile) -> bool:
        spot = [s for s in dict.fromkeys((shapes[0], shapes[len(shapes) // 2])) if s.n in cached.nodes]
        return not spot or agrees(cached, _measure(model, drafter, batch_size, mode, sampled, spot, budget_s / 8, scan))

    def measure() -> CostProfile:
        profile = _measure(model, drafter, batch_size, mode, sampled, shapes, budget_s, scan)
        if profile.plausible and (not checked or holds(profile)):
            return profile
        return _measure(model, drafter, batch_size, mode, sampled, shapes, budget_s, scan)
    profile = _cached("profile", model, CostProfile.from_dict, measure, fields, refresh,
                      keep=lambda profile: profile.plausible, holds=holds if checked else None)
    _MEMO[asked] = profile
    return profile


def agrees(cached: CostProfile, now: CostProfile) -> bool:
    """Whether ``now`` (a few sizes timed again) says what ``cached`` says: every size both hold
    costs an iteration in steps within a factor ``AGREE`` of the other's, and the cached plain
    step is at most ``STALE`` times the one timed now."""
    common = [n for n in now.nodes if n in cached.nodes]
    steps = ((cached.in_steps(n), now.in_steps(n)) for n in common)
    return cached.step_ms <= STALE * now.step_ms and all(max(a, b) <= AGREE * min(a, b) for a, b in steps)


def forget(profile: CostProfile) -> None:
    """Drop ``profile`` from the cache file, where this process read or wrote it there (the process
    keeps it): decoding found its plain steps far faster than it says
    (:class:`~stree.decoding.autotree.AutoTree`), so the next process measures it again. (The check
    a compiled profile cannot have before decoding: it would compile its calls again.)"""
    keys = [key for key, value in _MEMO.items() if value is profile and isinstance(key, str)]
    if not keys:  # (not the file's: nothing there to drop, and the file is not read for nothing)
        return
    try:
        data = json.loads(cache_file().read_text())
        gone = [data["entries"].pop(key) for key in keys if key in data["entries"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    if gone:
        _store(data)


def default_budget() -> float:
    """Seconds a first measurement takes its rounds in: ``$STREE_COST_SECONDS``, else 2."""
    text = os.environ.get("STREE_COST_SECONDS", "2")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= 600:
        raise ValueError(f"STREE_COST_SECONDS must be a number of seconds in (0, 600], got {text!r}")
    return seconds


def bracketed_profile(model, batch_size: int, **kwargs) -> CostProfile:
    """:func:`cost_profile` at ``batch_size`` where it is a power of two; between two, the profile
    interpolated between theirs (each measured once, then cached, as any profile): a caller whose
    batch size keeps changing (a serving engine's, as requests come and go) then measures a few
    sizes instead of every one, each measurement a pause of every row it serves."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    low = 1 << (batch_size.bit_length() - 1)
    if low == batch_size:
        return cost_profile(model, batch_size, **kwargs)
    low_profile = cost_profile(model, low, **kwargs)
    return _between(low_profile, cost_profile(model, 2 * low, **kwargs), (batch_size - low) / low)


@functools.lru_cache(maxsize=256)
def _between(low: CostProfile, high: CostProfile, w: float) -> CostProfile:
    """One object per interpolated profile, as :func:`cost_profile` keeps one per measured one: what
    adaptive choosers learn is kept per profile object (stree.decoding.autotree)."""
    return low.between(high, w)


def drafter_kind(drafter) -> str | None:
    """What a drafter's cost depends on: its class, whether it draws, and its model's."""
    if drafter is None:
        return None
    inner = getattr(drafter, "level_model", None)
    inner = inner if inner is None else (type(inner).__name__, _config_text(inner), str(inner.dtype))
    return repr((type(drafter).__name__, getattr(drafter, "stochastic", None), inner))


def _config_text(model) -> str:
    """``repr`` of the model's ``cfg``, made once per config object: a decoding call asks for its
    profile once, and the repr of a dataclass of some twenty fields, cold after decoding, was a
    fifth of the lookup."""
    cfg = getattr(model, "cfg", None)
    try:
        hit = _CONFIG_TEXT.get(model)
    except TypeError:  # (a model that cannot be weakly referenced)
        return repr(cfg)
    if hit is None or hit[0] is not cfg:
        hit = _CONFIG_TEXT[model] = (cfg, repr(cfg))
    return hit[1]


_CONFIG_TEXT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _binary(n: int):
    from ..tree import TreeShape

    return TreeShape(tuple([-1] + [(i - 1) // 2 for i in range(1, n)]))


# The plain steps after a tree pass that still pay for it (what it pushed out of the caches): a
# profile's plain step is timed past them, and what they take beyond it is the tree's. Timed as the
# step after another one, a plain step had been priced a sixth over a run's (compiled, batch 2, 2-core
# EPYC), and a tree less than it cost: the steps after it went uncounted. (AutoTree.AFTERMATH.)
WAKE = 3


def _timed_rounds(calls: list, budget_s: float, sync, keep_all: bool = False,
                  wake: int = 0) -> tuple[list[float], list[float]]:
    """Median milliseconds of the first calls of ``calls`` (the cheapest first): one warm-up
    call each (compiling, capturing, first-use work) until half the budget is spent (at least
    two calls are kept, and the budget starts after their warm-ups: a drafter's first use, which
    compiles or loads its compiled code once per process, had cut a profile to its smallest tree
    for good; ``keep_all``: every call, whatever its warm-up took), then rounds with the kept
    calls taking turns until ``budget_s`` is spent (at most 15). In a round each call runs twice and the second run is
    timed: the steady state a decoding loop sees, where steps of one kind mostly follow each
    other (a batch-8 plain step timed right after a 64-node pass measured several times its
    time in a run of steps: the pass's memory and caches, not the step's own work). ``wake``: the
    first call (a plain step) also runs that many times, timed, after each of the others, and
    starts each round after the last of those: with the medians, for each call what those runs
    took beyond the first call's median (at least 0; 0 for the first): its wake."""
    kept, start = [], 0.0
    for fn in calls:
        if not keep_all and len(kept) >= 2 and time.perf_counter() - start > budget_s / 2:
            break
        fn()
        kept.append(fn)
        if len(kept) == 2:
            start = time.perf_counter()
    times: list[list[float]] = [[] for _ in kept]
    after: list[list[float]] = [[] for _ in kept]  # the wake runs' sums

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) * 1e3

    start = time.perf_counter()
    for r in range(16):
        if r > 1 and time.perf_counter() - start > budget_s:
            break
        for i, (fn_times, fn) in enumerate(zip(times, kept)):
            if not (i == 0 and wake and r):  # (a plain step after the last call's wake runs is past its wake)
                fn()
                sync()
            fn_times.append(timed(fn))
            if i and wake:
                after[i].append(sum(timed(kept[0]) for _ in range(wake)))
    median = [statistics.median(t[1:] if len(t) > 2 else t) for t in times]
    wakes = [max(statistics.median(a[1:] if len(a) > 2 else a) - wake * median[0], 0.0) if a else 0.0
             for a in after]
    return median, wakes


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


@torch.no_grad()
def model_step_ms(model, batch: int, budget_s: float = 0.2) -> float:
    """Median milliseconds of ``model``'s own ``step`` over ``batch`` rows (:func:`_timed_rounds`'s
    steady state, its head over the whole vocabulary): what a drafter model's size costs, set beside
    its target's step (a level of its greedy drafts may cost less: they can cut the head). Not cached:
    ``stree profile`` reports it."""
    cache = model.allocate_cache(batch, 8)
    tokens = torch.zeros(batch, dtype=torch.long, device=model.device)

    def step():
        cache.seqlens.zero_()  # (the same position each time: the cache's room is never used up)
        model.step(tokens, cache)

    return _timed_rounds([step], budget_s, _sync(model.device))[0][0]


@torch.no_grad()
def _measure(model, drafter, batch: int, mode: str, sampled: bool, shapes, budget_s: float,
             scan: str = "tree") -> CostProfile:
    """A plain step and an iteration of each of ``shapes`` timed on a random context, as the loop
    runs them. One function for a reason: the timed calls (the closures) share the cache, the
    context and the drafter's rows exactly as the loop's steps do."""
    from ..drafters.base import DraftContext, TargetTop
    from ..models.layers.linear import following, leading
    from .steps import autoregressive_step, check_draft, speculative_step
    from ..tree import TokenTree
    from ..sampling.keyed import KeyedDraws
    from ..sampling.verify import SamplingParams

    device, vocab = model.device, model.vocab_size
    if drafter is not None:
        drafter = drafter.for_measuring()  # what it learns here must not reach the calls that decode
    depth = max([s.max_depth for s in shapes] + [1])
    # a warm-up call each, then in each of at most 16 rounds two a call and a plain step's WAKE after each tree
    context, calls_max = 32, (1 + len(shapes)) + 16 * (2 + (2 + WAKE) * len(shapes))
    if mode != "eager":
        from ..runtime.compiled import CompiledDecode
        from ..runtime.graphs import DecodeGraphs

        runner = (CompiledDecode if mode == "compiled" else DecodeGraphs).for_model(model, batch, context + 2 * depth)
        cache = runner.cache
    else:
        from ..runtime.runners import EagerRunner

        cache = model.allocate_cache(batch, context + 2 * depth)
        runner = EagerRunner(model, cache)
    gen = torch.Generator().manual_seed(0)
    # the drafter's rows grow by two tokens a speculative call (a draft accepted one deep, then a bonus)
    seq = torch.randint(0, vocab, (batch, context + 2 * calls_max + 1), generator=gen)
    lengths = torch.full((batch,), context)
    model.prefill(seq[:, :context].to(device), cache)
    params = SamplingParams(1.0 if sampled else 0.0)
    # sampled: keyed draws, as the loop's (stree.sampling.keyed), at the rows' first positions
    draws = KeyedDraws(0, device).at(np.arange(batch), np.zeros(batch)) if sampled else None
    top_k = None if drafter is None else drafter.target_top_k
    plain_top_k = None if drafter is None else drafter.plain_top_k  # what the loop's plain steps compute
    state = None if getattr(drafter, "generator", None) is None else drafter.generator.get_state()
    if drafter is not None:
        drafter.reset()

    rows = list(range(batch))

    def observe(host, count: int) -> None:
        """What the loop hands the drafter after a step: ``count`` emitted tokens a row (the next
        ones of ``seq``), with the target's laws where it learns from them."""
        target = None
        if host.top_ids is not None:
            target = [TargetTop(host.top_ids[b, :count], host.top_probs[b, :count], host.token_probs[b, :count])
                      for b in rows]
        ends = (lengths + count).tolist()
        drafter.observe(DraftContext(seq, lengths, rows),
                        [seq[b, e - count: e].tolist() for b, e in zip(rows, ends)], target)
        lengths.add_(count)

    def ar():
        with following():  # as the loop's plain steps (stree.decoding.loop)
            host = autoregressive_step(model, cache, seq[:, 0].to(device), params, draws, runner, plain_top_k)
        cache.seqlens -= 1
        if plain_top_k is not None:  # a drafter learning the target's law of every plain step
            observe(host, 1)

    drafting: list[list[float]] = [[] for _ in shapes]  # each call's drafting, of the call's time

    def spec(shape, drafted: list[float]):
        def run():
            t0 = time.perf_counter()
            if drafter is None:
                tree = TokenTree.from_shape(shape, seq[:, :shape.n])
            else:
                context = DraftContext(seq, lengths, rows)
                tree = drafter.propose(context, shape)
                check_draft(tree, context.last_tokens(), vocab)
                if tree.n > 1:  # the first child, as if it were accepted, then a bonus
                    seq[torch.arange(batch), lengths] = tree.tokens[:, 1]
            tree = tree.to(device)
            ms = (time.perf_counter() - t0) * 1e3
            with leading():  # as the loop's tree passes
                host, result = speculative_step(model, cache, tree, params, draws, scan, top_k=top_k, runner=runner)
            cache.seqlens -= result.num_accepted.to(cache.seqlens.dtype)
            if drafter is not None:  # the drafter learning from the step is drafting work, as in the loop
                t0 = time.perf_counter()
                observe(host, 2)
                ms += (time.perf_counter() - t0) * 1e3
            drafted.append(ms)
        return run

    inner = getattr(drafter, "level_model", None)
    catch_ms = 0.0
    try:
        # compiled passes and CUDA graphs: a few fixed sizes, each compiled (seconds on the CPU) before
        # it is timed; cut by the budget, the choice would know the smallest size alone
        ms, wakes = _timed_rounds([ar] + [spec(s, d) for s, d in zip(shapes, drafting)], budget_s, _sync(device),
                                  keep_all=mode != "eager", wake=WAKE)
        shapes = shapes[: len(ms) - 1]  # the sizes measured within the budget
        if inner is not None:  # the drafter model reading a context of CATCH tokens (a probe's catch-up)
            own = inner.allocate_cache(batch, CATCH)
            ids = (seq[:, :CATCH] % inner.vocab_size).to(inner.device)
            catch_ms = _timed_rounds([lambda: (own.seqlens.zero_(), inner.prefill(ids, own))], budget_s / 8,
                                     _sync(device))[0][0] / CATCH
    finally:
        if drafter is not None:
            drafter.reset()
            if state is not None:
                drafter.generator.set_state(state)
    cache.seqlens.zero_()
    draft = [statistics.median(d[2:] if len(d) > 3 else d) for d in drafting[: len(shapes)]]  # warm-up left out
    nodes = [s.n for s in shapes]
    tree = nondecreasing([max(t - d, 1e-3) + w for t, d, w in zip(ms[1:], draft, fitted_wakes(nodes, wakes[1:]))])
    return CostProfile(ms[0], tuple(nodes), tuple(tree), tuple(draft), catch_ms,
                       tuple(s.max_depth for s in shapes) if inner is not None else ())


def fitted_wakes(nodes: list[int], wakes: list[float]) -> list[float]:
    """Each size's wake (:func:`_timed_rounds`) as the least-squares line a + b nodes through all
    of them (a and b at least 0; one that comes out negative is left out and the other fitted
    again). What a pass pushes out of the caches grows smoothly with its nodes, but timed per size,
    as three plain steps' sum less three medians, a wake scattered by a tenth of a step or more
    (at batch 2 on the 2-core Xeon with AMX, from none to a sixth of a plain step for 2 to 8 nodes
    and from 0.13 to 0.3 steps for 16, in four profiles): noise in every size's price, and the
    choice takes whichever size it happens to make cheap."""
    if len(nodes) < 3:
        return list(wakes)
    n, w = np.asarray(nodes, dtype=np.float64), np.asarray(wakes, dtype=np.float64)
    a, b = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), w, rcond=None)[0]
    if b < 0:
        a, b = max(float(w.mean()), 0.0), 0.0
    elif a < 0:
        a, b = 0.0, max(float(n @ w / (n @ n)), 0.0)
    return [float(a + b * x) for x in n]


def nondecreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence to ``values`` in squared error (adjacent violators
    pooled into their mean): a tree of more nodes does the work of a smaller one and more, so a
    larger size timed below a smaller one was measured by noise, which the choice would seize."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks[-1]
            blocks[-1] = [(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2]
    return [m for m, c in blocks for _ in range(int(c))]


def describe(profile: CostProfile) -> list[dict]:
    """The profile as table rows: nodes, the target's and the drafter's milliseconds, and the
    whole iteration in autoregressive steps."""
    rows = [dict(nodes=1, target_ms=profile.step_ms, draft_ms=0.0, steps=1.0)]
    rows += [dict(nodes=n, target_ms=t, draft_ms=d, steps=profile.in_steps(n))
             for n, t, d in zip(profile.nodes, profile.tree_ms, profile.draft_ms)]
    return rows

