"""Keyed draws (stree.sampling.keyed): each uniform a function of (seed, row, position) alone,
uniform and independent by chi-square (fixed seeds, p-value > 1e-3), the inverse CDF of every
path equal, and a tree's keyed walk emitting, token by token, what plain draws at the same
positions would: the definition walked in Python on random trees."""

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import trees

from stree.sampling.keyed import KeyedDraws, draw_at, inverse_cdf_tensors
from stree.sampling.verify import SamplingParams, verify
from stree.testing import chi_square
from stree.tree import TokenTree, TreeShape

verify_module = sys.modules["stree.sampling.verify"]


def test_a_uniform_depends_on_its_seed_row_and_position_alone():
    draws = KeyedDraws(5)
    rows, positions = np.repeat(np.arange(4), 50), np.tile(np.arange(50), 4)
    u = draws.uniforms(rows, positions)
    assert u.dtype == np.float64 and (u >= 0).all() and (u < 1).all() and len(np.unique(u)) == len(u)
    order = np.random.default_rng(0).permutation(len(u))  # any order, any batching: the same numbers
    assert np.array_equal(draws.uniforms(rows[order], positions[order]), u[order])
    assert np.array_equal(KeyedDraws(5).uniforms(rows, positions), u)
    assert not np.isin(KeyedDraws(6).uniforms(rows, positions), u).any()
    placed = draws.at([2, 0], [7, 0]).depths(3)
    assert torch.equal(placed, torch.from_numpy(np.stack([draws.uniforms(2, [7, 8, 9]), draws.uniforms(0, [0, 1, 2])])))


def test_a_seed_per_row_keys_each_row_as_a_call_of_that_row_alone():
    positions = np.arange(40)
    per_row = KeyedDraws([5, 9, 5])
    for row, seed in enumerate([5, 9, 5]):
        assert np.array_equal(per_row.uniforms(row, positions), KeyedDraws(seed).uniforms(0, positions))
    assert np.array_equal(KeyedDraws([5]).uniforms(0, positions), KeyedDraws(5).uniforms(0, positions))
    with pytest.raises(ValueError, match=r"rows must be in \[0, 3\)"):
        per_row.uniforms(3, 0)
    with pytest.raises(ValueError, match="non-empty sequence"):
        KeyedDraws([])


def test_row_keys_and_starts_continue_the_rows_of_a_call():
    """Per-row seeds with ``keys`` and ``starts``: a row continuing row k of a call of its seed, t
    tokens in, draws what that call's row k draws from position t on."""
    positions = np.arange(30)
    going = KeyedDraws([5, 9, 5], keys=[2, 0, 0], starts=[7, 0, 3])
    for row, (seed, key, start) in enumerate([(5, 2, 7), (9, 0, 0), (5, 0, 3)]):
        assert np.array_equal(going.uniforms(row, positions), KeyedDraws(seed).uniforms(key, positions + start))
    for bad in (dict(keys=[0, 1]), dict(starts=[0, 1, 2, 3])):
        with pytest.raises(ValueError, match="one int per row"):
            KeyedDraws([5, 9, 5], **bad)
    with pytest.raises(ValueError, match="go with one seed per row"):
        KeyedDraws(5, keys=[0])


def test_the_uniforms_are_uniform_and_neighbours_independent():
    """200k uniforms of 400 rows x 500 positions in 20 bins, and the pairs of neighbouring
    positions in 10 x 10 cells: chi-square p-values > 1e-3 (fixed seed)."""
    rows, positions = np.meshgrid(np.arange(400), np.arange(500), indexing="ij")
    u = KeyedDraws(1234).uniforms(rows, positions)
    bins = torch.from_numpy(np.floor(u * 20).astype(np.int64)).flatten()
    assert chi_square(torch.bincount(bins, minlength=20), torch.full((20,), 1 / 20))[2] > 1e-3
    cells = np.floor(u[:, :-1] * 10).astype(np.int64) * 10 + np.floor(u[:, 1:] * 10).astype(np.int64)
    assert chi_square(torch.bincount(torch.from_numpy(cells).flatten(), minlength=100),
                      torch.full((100,), 1 / 100))[2] > 1e-3


@pytest.mark.parametrize("rows, positions", [([-1], [0]), ([0], [-3]), ([1 << 31], [0]), ([0], [1 << 32])])
def test_rows_and_positions_out_of_range_are_refused(rows, positions):
    with pytest.raises(ValueError, match="must be in"):
        KeyedDraws(0).uniforms(np.array(rows), np.array(positions))


def test_the_inverse_cdf_is_one_on_every_device_path_and_never_takes_a_zero():
    """The compiled CPU pass against torch's cumulative sums (what other devices run), on rows
    with zeros, at uniforms spread over [0, 1) and at its ends."""
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(300, 50, generator=g) ** 4
    probs[probs < 0.05] = 0
    probs[:, 7] += 1e-3  # (no row without mass)
    u = torch.cat([torch.rand(298, generator=g, dtype=torch.float64), torch.tensor([0.0, 1 - 2**-53])])
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    want[-1] = int(torch.nonzero(probs[-1])[-1])  # (u * total rounds up to the total there: the last entry above 0)
    for path, draw in (("compiled", draw_at), ("tensors", inverse_cdf_tensors)):
        got = draw(probs, u)
        assert torch.equal(got, want), path
        assert bool((probs.gather(1, got[:, None]) > 0).all())


def _plain_draws(probs_b, tokens_b, valid_b, parents, u_b):
    """The definition for one row: from the root, each node's choice is the inverse CDF of its law
    at the uniform of its depth; move to the first valid child holding it; emit the accepted
    drafts, then the last choice."""
    node, depth, emitted = 0, 0, []
    while True:
        cdf = probs_b[node].double().cumsum(0)
        choice = int(torch.searchsorted(cdf, u_b[depth] * cdf[-1], right=True))
        nxt = [c for c in range(len(parents)) if parents[c] == node and valid_b[c] and tokens_b[c] == choice]
        if not nxt:
            return emitted + [choice]
        node, depth = nxt[0], depth + 1
        emitted.append(int(tokens_b[node]))


@settings(max_examples=60, deadline=None)
@given(trees(max_n=24), st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_a_keyed_walk_emits_what_plain_draws_at_the_same_positions_would(tree_and_batch, masked, compiled, seed):
    """Random trees of deterministic drafts over 3 tokens (repeats among siblings), invalid nodes,
    the compiled CPU walk and the tensor path: the emitted tokens are the definition's, and the
    first one is what a plain step at the row's position draws (:meth:`SamplingParams.sample`)."""
    parents, B = tree_and_batch
    g = torch.Generator().manual_seed(seed)
    V, n = 3, parents.shape[-1]
    tokens = torch.randint(0, V, (B, n), generator=g)
    valid = None
    if masked:
        valid = torch.rand(tokens.shape, generator=g) > 0.25
        valid[:, 0] = True
    tree = TokenTree(parents, tokens, valid=valid)
    logits = torch.randn(B, n, V, generator=g) * 2
    params = SamplingParams(0.8)
    draws = KeyedDraws(seed).at(np.arange(B) * 3, np.arange(B) + 5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify_module, "COMPILED_ON_CPU", compiled)
        res = verify(tree, logits, params, generator=draws)
    probs, u = params.probs(logits), draws.depths(n + 1)
    for b in range(B):
        ok = torch.ones(n, dtype=torch.bool) if valid is None else valid[b]
        rows = tree.parents.reshape(-1, n)
        want = _plain_draws(probs[b], tokens[b], ok, rows[min(b, len(rows) - 1)].tolist(), u[b])
        got = tokens[b, res.accepted[b, 1: res.num_accepted[b]]].tolist() + [int(res.bonus[b])]
        assert got == want
    first = params.sample(logits[:, 0], draws)
    assert torch.equal(first, torch.tensor([_plain_draws(probs[b], tokens[b], torch.zeros(n, dtype=torch.bool), [-1] * n,
                                                         u[b])[0] for b in range(B)]))


def test_keyed_verification_samples_the_target_law_chi_square():
    """200k rows of a one-level tree of fixed drafts verified at keyed draws (one row key each):
    the first emitted token's counts fit p (p-value > 1e-3, fixed seed)."""
    V, m, B = 6, 3, 200_000
    p = torch.tensor([0.3, 0.0, 0.25, 0.05, 0.3, 0.1], dtype=torch.float64)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), torch.tensor([4, 1, 2]).expand(B, m)], 1)
    tree = TokenTree(TreeShape.full(m, 1).parents_tensor(), tokens)
    res = verify(tree, p.float().log().expand(B, m + 1, V), temperature=1.0,
                 generator=KeyedDraws(9).at(np.arange(B), np.zeros(B, dtype=np.int64)))
    first = torch.where(res.num_accepted > 1, tokens.gather(1, res.accepted[:, 1:2])[:, 0], res.bonus)
    assert chi_square(torch.bincount(first, minlength=V), p)[2] > 1e-3


def test_keyed_verification_on_the_device_is_the_cpu_walk(device):
    """The same draws on the device (CUDA where there is one: the tensor path, draws moved there)
    and in the CPU's compiled walk: the same paths and bonus tokens, on a tree whose drafts the
    target's peaked laws often take."""
    g = torch.Generator().manual_seed(3)
    B, V = 4, 50
    shape = TreeShape.full(2, 3)
    logits = torch.randn(B, shape.n, V, generator=g) * 3
    tokens = torch.randint(0, V, (B, shape.n), generator=g)
    tokens[:, 1:] = torch.where(torch.rand(B, shape.n - 1, generator=g) < 0.5, logits.argmax(-1).gather(
        1, torch.tensor(shape.parents[1:]).expand(B, -1)), tokens[:, 1:])  # (half the drafts their parent's argmax)
    params = SamplingParams(0.3)
    draws = KeyedDraws(21).at(np.arange(B), np.array([0, 5, 9, 2]))
    want = verify(TokenTree.from_shape(shape, tokens), logits, params, generator=draws)
    got = verify(TokenTree.from_shape(shape, tokens.to(device)), logits.to(device), params, generator=draws)
    assert int(want.num_accepted.max()) > 1
    for a, b in zip((want.accepted, want.num_accepted, want.bonus), (got.accepted, got.num_accepted, got.bonus)):
        assert torch.equal(a, b.cpu())
