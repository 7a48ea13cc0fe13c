"""Seeded draws keyed by where they land: the uniform that picks a row's t-th generated token is a
function of (seed, row, t) alone, not of how many numbers were drawn before it.

With a sequential generator, a speculative call consumes its numbers in an order set by the trees
it verifies, so a seed's sampled output depends on the trees chosen (and a tree choice that follows
the clock would make it depend on timing). Keyed draws remove that dependence for deterministic
drafts (every drafter that draws nothing: n-gram, STAND's deterministic trees, ...): each node of a
tree at depth d picks its token by the inverse of its distribution's CDF at the uniform of position
t + d, and the walk follows the child holding that token (the ``naive`` rule of
:mod:`stree.sampling.verify`, with the one-hot rule's law). The token emitted at position t is then
the inverse CDF of the target's distribution after the same prefix at the same uniform, exactly as
a plain step draws it: a seed gives the same tokens with any drafter of deterministic drafts, any
tree, or none (up to the target's logits in a tree pass and a step differing in the last bits, as
for greedy decoding's argmax). Random drafts (a drafter's own draws, ``child_probs``) keep the
rejection rules, which need coins of their own: those come from a sequential stream
(:attr:`KeyedDraws.generator`), and there the output follows the trees as before.

The uniforms: splitmix64's finaliser applied twice to a counter that holds row and position,
mixed with two keys derived from the seed (NumPy's ``SeedSequence``); 53 bits each, in [0, 1).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
from numba import njit

__all__ = ["KeyedDraws", "Placed", "draw_at", "inverse_cdf_tensors"]

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11, _S32 = (np.uint64(s) for s in (30, 27, 31, 11, 32))
_ROWS, _KEYS = 1, 2  # what _uniforms found out of range


@njit(cache=True)
def _mix(z):
    """splitmix64's finaliser on a uint64 (the products wrap modulo 2**64, as intended)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True)
def _uniforms(words, row_keys, starts, per_row, rows, positions, out):
    """``out[i]``: the uniform of ``rows[i]`` at ``positions[i]`` (one compiled pass: a step asks
    for a handful, and a dozen NumPy calls on them cost a sampled step several percent). Returns 0,
    or ``_ROWS`` / ``_KEYS`` at the first entry out of range."""
    top = len(words) if per_row else 1 << 31
    for i in range(len(rows)):
        row, at = rows[i], positions[i]
        if row < 0 or row >= top or at < 0:
            return _ROWS
        w, key = 0, row
        if per_row:  # (the row's own seed, key and start)
            w, key, at = row, row_keys[row], at + starts[row]
        if key < 0 or key >= 1 << 31 or at >= 1 << 32:
            return _KEYS
        z = _mix(_mix(((np.uint64(key) << _S32) | np.uint64(at)) ^ words[w, 0]) + words[w, 1])
        out[i] = np.float64(z >> _S11) * (1.0 / (1 << 53))
    return 0


class KeyedDraws:
    """The draws of one call: :meth:`at` places them at the device batch's rows and the positions
    those rows reached; ``generator`` is the sequential stream the rejection rules of random drafts
    take their coins from. ``seed``: an int (row r's draws keyed by it and r), or a sequence of one
    int per row (row r's keyed by its own alone, as a call of that row alone with that seed keys its
    one row: a row's draws then do not depend on the batch it is in). With a sequence, ``keys``
    and ``starts`` (default 0 each) say, per row, which row of a call of its seed it is and how
    many tokens it generated before: a caller continuing rows (the serving engine) draws what each
    row's own call would."""

    def __init__(self, seed, device: torch.device | str = "cpu", keys=None, starts=None):
        self.per_row = not isinstance(seed, numbers.Integral)
        if self.per_row and not len(seed):
            raise ValueError("seed must be an int or a non-empty sequence of ints, one per row")
        if not self.per_row and (keys is not None or starts is not None):
            raise ValueError("keys and starts go with one seed per row")
        words = np.stack([np.random.SeedSequence(s).generate_state(3, np.uint64)
                          for s in (seed if self.per_row else [seed])])
        self._words = words[:, :2]
        self._row_keys, self._starts = (np.zeros(len(words), dtype=np.int64) if v is None else np.asarray(v, np.int64)
                                        for v in (keys, starts))
        if self._row_keys.shape != (len(words),) or self._starts.shape != (len(words),):
            raise ValueError(f"keys and starts must hold one int per row ({len(words)})")
        self.generator = torch.Generator(device=device).manual_seed(int(words[0, 2] >> np.uint64(1)))

    @property
    def rows(self) -> int | None:
        """The rows of per-row seeds (None: one seed for any rows)."""
        return len(self._words) if self.per_row else None

    def uniforms(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """float64 uniforms in [0, 1), one per entry of ``rows`` and ``positions`` (int arrays of
        one shape, broadcast), each a function of its row's seed, its row and its position alone."""
        rows, positions = np.broadcast_arrays(np.asarray(rows, dtype=np.int64), np.asarray(positions, dtype=np.int64))
        out = np.empty(rows.shape)
        error = _uniforms(self._words, self._row_keys, self._starts, self.per_row, np.ascontiguousarray(rows).ravel(),
                          np.ascontiguousarray(positions).ravel(), out.reshape(-1))
        if error == _ROWS:
            raise ValueError(f"rows must be in [0, {len(self._words) if self.per_row else 1 << 31}) and positions >= 0")
        if error == _KEYS:
            raise ValueError("row keys must be in [0, 2**31) and positions in [0, 2**32)")
        return out

    def at(self, rows, positions) -> "Placed":
        """The draws of a step whose device batch holds rows ``rows`` (their indices in the call),
        which have generated ``positions`` tokens each so far."""
        return Placed(self, np.asarray(rows, dtype=np.int64), np.asarray(positions, dtype=np.int64))


class Placed:
    """A :class:`KeyedDraws` at one step: ``depths(L)`` gives each row's uniforms for its next
    ``L`` positions (``[B, L]`` float64), the first of which a plain step draws with."""

    def __init__(self, draws: KeyedDraws, rows: np.ndarray, positions: np.ndarray):
        self.draws, self.rows, self.positions = draws, rows, positions

    @property
    def generator(self) -> torch.Generator:
        return self.draws.generator

    def depths(self, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        u = self.draws.uniforms(self.rows[:, None], self.positions[:, None] + np.arange(length))
        return torch.from_numpy(u).to(device)


def draw_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs [R, V]`` (entries >= 0, a positive total per row): the inverse
    of the row's float64 cumulative sums at ``u [R]`` in [0, 1) (scaled by the total); an entry of
    0 is never taken. On the CPU one compiled pass, the sums a tree's keyed walk takes
    (:func:`~stree.sampling.verify_jit.keyed_walk`); elsewhere :func:`inverse_cdf_tensors` (the two
    tested equal on the CPU; a GPU's parallel cumulative sums may differ in the last bits)."""
    if probs.device.type == "cpu":
        from .verify_jit import inverse_cdf_rows

        out = np.empty(probs.shape[0], dtype=np.int64)
        inverse_cdf_rows(np.ascontiguousarray(probs.detach().float().numpy()),
                         np.ascontiguousarray(u.to(torch.float64).numpy()), out)
        return torch.from_numpy(out)
    return inverse_cdf_tensors(probs, u)


def inverse_cdf_tensors(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`draw_at` in tensor ops, for any device."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    # (below the total, also where the product rounds up to it: the sums first exceed it at the last
    # entry above 0; clamped: a NaN row draws an index in range, and the step's finiteness check reports it)
    at = torch.minimum(u.to(cdf.device, torch.float64) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, at[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
