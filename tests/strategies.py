"""Hypothesis strategies: parent arrays of every shape a drafter can produce, SSM shapes, and accepted paths."""

import math

import torch
from hypothesis import strategies as st

TREE_KINDS = ("random", "chain", "star", "deep_bushy")


@st.composite
def parent_lists(draw, n):
    kind = draw(st.sampled_from(TREE_KINDS))
    parents = [-1]
    for i in range(1, n):
        if kind == "chain":
            parents.append(i - 1)
        elif kind == "star":
            parents.append(0)
        elif kind == "deep_bushy":  # long paths that keep branching near their ends
            parents.append(draw(st.integers(max(0, i - 3), i - 1)))
        else:
            parents.append(draw(st.integers(0, i - 1)))
    return parents


@st.composite
def trees(draw, max_n=40, batch=None):
    """(parents tensor ``[n]`` or ``[batch, n]`` with different trees per row, batch)."""
    batch = batch if batch is not None else draw(st.integers(1, 3))
    n = draw(st.one_of(st.just(1), st.integers(1, max_n)))
    if batch > 1 and draw(st.booleans()):
        return torch.tensor([draw(parent_lists(n)) for _ in range(batch)]), batch
    return torch.tensor(draw(parent_lists(n))), batch


@st.composite
def ssm_shapes(draw):
    ngroups = draw(st.sampled_from([1, 2]))
    return dict(
        ngroups=ngroups,
        nheads=ngroups * draw(st.sampled_from([1, 2])),
        headdim=draw(st.sampled_from([1, 5, 8, 12, 16, 20, 40, 72])),  # > 32 / 64: several p-blocks
        dstate=draw(st.sampled_from([1, 3, 8, 16, 24])),
    )


@st.composite
def dt_options(draw):
    """Keyword arguments for dt handling: bias, softplus and limit each on or off."""
    softplus = draw(st.booleans())
    limit = draw(st.sampled_from([(0.0, math.inf), (0.002, 0.05)]))
    return dict(dt_softplus=softplus, dt_limit=limit, use_bias=draw(st.booleans()))


def ssm_inputs(gen, batch, n, shape, dt_opts, dtype=torch.float32, D_kind="head"):
    """Random inputs; without softplus dt is used raw, so it is drawn positive and small."""
    from stree.testing import random_ssm_inputs

    inp = random_ssm_inputs(batch, n, shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"],
                            dtype=dtype, generator=gen, D_per_dim=D_kind == "dim")
    if not dt_opts["dt_softplus"]:
        inp["dt"] = inp["dt"].abs() * 0.05
        inp["dt_bias"] = torch.full_like(inp["dt_bias"], 0.01)
    if not dt_opts["use_bias"]:
        inp["dt_bias"] = None
    if D_kind == "none":
        inp["D"] = None
    return inp


@st.composite
def accepted_paths(draw, parents, batch):
    """Per row a root-first path walking down random children; the tail past num_accepted is junk."""
    rows, nums = [], []
    for b in range(batch):
        par = (parents if parents.dim() == 1 else parents[b]).tolist()
        kids = {i: [j for j in range(len(par)) if par[j] == i] for i in range(len(par))}
        path = [0]
        while kids[path[-1]] and draw(st.integers(0, 4)) > 0:
            path.append(draw(st.sampled_from(kids[path[-1]])))
        rows.append(path)
        nums.append(len(path))
    L = max(nums) + draw(st.integers(0, 2))
    junk = draw(st.sampled_from([-1, 10**6]))
    return torch.tensor([r + [junk] * (L - len(r)) for r in rows]), torch.tensor(nums)


def by(backend):
    """``assert_close``'s message with the backend's name before torch's own (which says how far off)."""
    return lambda message: f"{backend}: {message}"
