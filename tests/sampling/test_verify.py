"""Verification rules: exact laws by enumeration (to 1e-9, float64), sampling by chi-square, greedy
against a plain walk, and the known-wrong variants caught by the same checks."""

import itertools
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import trees

from stree.testing import chi_square
from stree.tree import TokenTree, TreeShape
from stree.sampling.verify import (SamplingParams, acceptance_tables, choose_rule, draw, follow_choices,
                                  process_logits, sample_tokens, verify)

verify_module = sys.modules["stree.sampling.verify"]

EXACT = 1e-9


def dirichlet(V, g, zeros=0):
    p = torch.distributions.Gamma(torch.ones(V, dtype=torch.float64), 1.0).sample()
    if zeros:
        p[torch.randperm(V, generator=g)[:zeros]] = 0
    return p / p.sum()


# ---------------------------------------------------------------- one node


def draw_sequences(q, m, with_replacement):
    """Every ordered draw of m children from q with its probability (without replacement:
    sequential draws from q restricted to unseen tokens; slots past q's support stay undrawn, -1)."""
    V = len(q)
    if with_replacement:
        for seq in itertools.product(range(V), repeat=m):
            w = float(torch.prod(q[list(seq)]))
            if w > 0:
                yield list(seq), w
        return
    support = int((q > 0).sum())
    for seq in itertools.permutations(range(V), min(m, support)):
        w, left = 1.0, 1.0
        for x in seq:
            w *= float(q[x]) / left
            left -= float(q[x])
        if w > 0:
            yield list(seq) + [-1] * (m - len(seq)), w


def one_node_tree(children, q=None, with_replacement=False, K=None):
    """Root (token 0) with the given children (-1 = an undrawn, invalid slot); ``q`` is the
    declared law at the root, stored sparsely over its first K entries."""
    m = len(children)
    tokens = torch.tensor([[0] + [max(c, 0) for c in children]])
    valid = torch.tensor([[True] + [c >= 0 for c in children]])
    kw = {}
    if q is not None:
        V = len(q)
        K = K or V
        ids = torch.zeros(1, m + 1, K, dtype=torch.long)
        ids[0, 0] = torch.arange(K)
        probs = torch.zeros(1, m + 1, K, dtype=torch.float64)
        probs[0, 0] = q[:K]
        kw = dict(child_ids=ids, child_probs=probs, with_replacement=with_replacement)
    return TokenTree(TreeShape.full(m, 1).parents_tensor(), tokens, valid, **kw)


def emitted_law(tree, p, rule):
    """Exact law of the token emitted at the root: children tried in order, then the residual."""
    probs = p.expand(1, tree.n, -1).clone()
    accept, residual = acceptance_tables(tree, probs, rule)
    law, reach = torch.zeros_like(p), 1.0
    for c in range(1, tree.n):
        law[tree.tokens[0, c]] += reach * accept[0, c]
        reach = reach * (1 - accept[0, c])
    return law + reach * residual[0, 0]


def stochastic_law(p, q, m, with_replacement, rule):
    law = torch.zeros_like(p)
    for seq, w in draw_sequences(q, m, with_replacement):
        law += w * emitted_law(one_node_tree(seq, q, with_replacement), p, rule)
    return law


def cases(V, g):
    """(p, q) pairs: random, with zeros, q = p, one-hot q, p with zeros where q has mass."""
    p, q = dirichlet(V, g), dirichlet(V, g)
    yield p, q
    yield dirichlet(V, g, zeros=2), dirichlet(V, g, zeros=2)
    yield p, p.clone()
    yield p, torch.nn.functional.one_hot(torch.tensor(1), V).double()
    yield dirichlet(V, g, zeros=V - 2), q  # p concentrated on 2 tokens
    yield p, dirichlet(V, g, zeros=V - 2)  # q support 2 < m = 3 children


@pytest.mark.parametrize("V", [5, 8])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("with_replacement", [True, False])
def test_stochastic_rules_emit_p_exactly(V, m, with_replacement):
    torch.manual_seed(V * 10 + m)
    g = torch.Generator().manual_seed(V + m)
    rule = "iid" if with_replacement else "without_replacement"
    for p, q in cases(V, g):
        law = stochastic_law(p, q, m, with_replacement, rule)
        assert (law - p).abs().max() < EXACT, (p, q)


@pytest.mark.parametrize("V", [5, 8])
def test_one_hot_rule_emits_p_for_any_fixed_children(V):
    torch.manual_seed(V)
    g = torch.Generator().manual_seed(V)
    for _ in range(20):
        p = dirichlet(V, g, zeros=int(torch.randint(0, V - 1, (1,))))
        m = int(torch.randint(1, 4, (1,)))
        children = torch.randint(0, V, (m,)).tolist()  # duplicates included
        law = emitted_law(one_node_tree(children), p, "one_hot")
        assert (law - p).abs().max() < EXACT, (p, children)
    p = dirichlet(V, g)
    law = emitted_law(one_node_tree([2, -1, 3]), p, "one_hot")  # an invalid slot is skipped
    assert (law - p).abs().max() < EXACT


def test_wrong_variants_are_caught_by_the_same_check():
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(3)
    worst_base_q, worst_truncated = 0.0, 0.0
    for _ in range(10):
        p, q = dirichlet(6, g), dirichlet(6, g)
        # Base-q residual (the i.i.d. rule) applied to children drawn without replacement.
        law = torch.zeros_like(p)
        for seq, w in draw_sequences(q, 3, with_replacement=False):
            law += w * emitted_law(one_node_tree(seq, q, with_replacement=True), p, "iid")
        worst_base_q = max(worst_base_q, float((law - p).abs().max()))
        # Draws from the renormalised top-3 of q, but the declared law is q's unnormalised entries
        # (the rest of the mass left on other tokens): q(x) is underestimated for every draw.
        top = torch.topk(q, 3).indices
        q_trunc = torch.zeros_like(q)
        q_trunc[top] = q[top] / q[top].sum()
        law = torch.zeros_like(p)
        for seq, w in draw_sequences(q_trunc, 2, with_replacement=False):
            law += w * emitted_law(one_node_tree(seq, q, with_replacement=False), p, "without_replacement")
        worst_truncated = max(worst_truncated, float((law - p).abs().max()))
    assert worst_base_q > 1e-2 and worst_truncated > 1e-2


def test_stored_top_k_probabilities_are_renormalised_before_use():
    """A drafter may store its top-K entries unnormalised: the verifier divides by their mass."""
    g = torch.Generator().manual_seed(5)
    p, q = dirichlet(7, g), dirichlet(7, g)
    q_sorted = torch.sort(q, descending=True).values
    K = 4
    q_trunc = torch.zeros_like(q_sorted)
    q_trunc[:K] = q_sorted[:K] / q_sorted[:K].sum()
    law = torch.zeros_like(p)
    for seq, w in draw_sequences(q_trunc, 2, with_replacement=False):
        # declared over the first K ids only, with the raw (unnormalised) stored values
        law += w * emitted_law(one_node_tree(seq, q_sorted, with_replacement=False, K=K), p, "without_replacement")
    assert (law - p).abs().max() < EXACT


def test_naive_rule_emits_p_exactly_by_enumerating_the_target_draw():
    g = torch.Generator().manual_seed(1)
    V = 6
    p = dirichlet(V, g, zeros=1)
    tree = one_node_tree([3, 1, 3])
    law = torch.zeros_like(p)
    for y in range(V):
        choice = torch.full((1, tree.n), 0)
        choice[0, 0] = y
        accepted, num, bonus = follow_choices(tree, choice)
        emitted = int(tree.tokens[0, accepted[0, 1]]) if num[0] > 1 else int(bonus[0])
        law[emitted] += p[y]
    assert (law - p).abs().max() < EXACT


# ---------------------------------------------------------------- two levels


def markov_setup(V, seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    P = torch.stack([dirichlet(V, g, zeros=1) for _ in range(V)])  # target p(next | token)
    Q = torch.stack([dirichlet(V, g, zeros=1) for _ in range(V)])  # drafter q(next | token)
    return P, Q


ROOT = 0


def two_level_trees(Q, width, with_replacement):
    """Every draft tree of ``full(width, 2)`` (children of a node drawn from Q[node token]) with its
    probability, batched: ``(TokenTree [B, n], weights [B])``. Width 1 is a chain of 2 drafts."""
    V = Q.shape[0]
    shape = TreeShape.full(width, 2)
    kids = shape.children()
    rows, weights = [], []
    for top, w1 in draw_sequences(Q[ROOT], width, with_replacement):
        subs = [list(draw_sequences(Q[max(t, 0)], width, with_replacement)) for t in top]
        for below in itertools.product(*subs):
            rows.append([ROOT] + top + [t for seq, _ in below for t in seq])
            weights.append(w1 * float(torch.prod(torch.tensor([w for _, w in below], dtype=torch.float64))))
    raw = torch.tensor(rows)
    valid = raw >= 0
    for c in kids[0]:
        valid[:, kids[c]] &= valid[:, c:c + 1]
    tokens = raw.clamp(min=0)
    B = len(rows)
    ids = torch.arange(V).expand(B, shape.n, V)
    tree = TokenTree(shape.parents_tensor(), tokens, valid, child_ids=ids, child_probs=Q[tokens],
                     with_replacement=with_replacement)
    return tree, torch.tensor(weights, dtype=torch.float64)


def exact_joint(P):
    """Law of the first two emitted tokens when sampling from P token by token after ROOT."""
    return P[ROOT][:, None] * P


def tree_joint(tree, weights, P, rule):
    """Exact law of the first two emitted tokens of one verify step (continued by plain sampling
    from P when the step emits one token), averaged over the draft trees."""
    V = P.shape[0]
    probs = P[tree.tokens]
    accept, residual = acceptance_tables(tree, probs, rule)
    joint = torch.zeros(V, V, dtype=torch.float64)
    kids = tree.children()
    for b in range(tree.batch_size):
        w, tok = float(weights[b]), tree.tokens[b].tolist()
        reach = 1.0
        for c in kids[0]:
            into_c = reach * float(accept[b, c])
            reach_c = 1.0
            for gc in kids[c]:
                joint[tok[c], tok[gc]] += w * into_c * reach_c * float(accept[b, gc])
                reach_c *= 1 - float(accept[b, gc])
            joint[tok[c]] += w * into_c * reach_c * residual[b, c]
            reach *= 1 - float(accept[b, c])
        joint += w * reach * residual[b, 0][:, None] * P
    return joint


@pytest.mark.parametrize("width", [1, 2], ids=["chain", "tree"])
@pytest.mark.parametrize("with_replacement", [True, False])
def test_two_level_drafts_emit_the_exact_joint_law(width, with_replacement):
    """Width 1 is chain speculative sampling (2 drafts); width 2 a binary tree of depth 2."""
    P, Q = markov_setup(4, seed=11 + with_replacement + 2 * width)
    tree, weights = two_level_trees(Q, width, with_replacement)
    rule = "iid" if with_replacement else "without_replacement"
    joint = tree_joint(tree, weights, P, rule)
    assert abs(float(weights.sum()) - 1) < EXACT
    assert (joint - exact_joint(P)).abs().max() < EXACT
    if width == 2 and not with_replacement:  # and the base-q variant is caught at depth 2 as well
        wrong = tree_joint(TokenTree(tree.parents, tree.tokens, tree.valid, tree.child_ids, tree.child_probs, True),
                           weights, P, "iid")
        assert (wrong - exact_joint(P)).abs().max() > 1e-3


def test_two_level_naive_sampling_emits_the_exact_joint_law():
    V = 3
    P, _ = markov_setup(V, seed=4)
    shape = TreeShape.full(2, 2)
    tokens = torch.tensor([[ROOT, 1, 2, 0, 1, 2, 2]])  # fixed drafts, a duplicate among cousins
    tree = TokenTree(shape.parents_tensor(), tokens)
    choices = torch.tensor(list(itertools.product(range(V), repeat=shape.n)))  # one draw per node
    B = len(choices)
    batch = TokenTree(shape.parents_tensor(), tokens.expand(B, -1))
    weights = torch.prod(P[tokens.expand(B, -1), choices], dim=1)
    accepted, num, bonus = follow_choices(batch, choices)
    joint = torch.zeros(V, V, dtype=torch.float64)
    path_tok = tokens[0][accepted]
    for b in range(B):
        if num[b] == 1:
            joint[bonus[b]] += weights[b] * P[bonus[b]]
        else:
            t2 = path_tok[b, 2] if num[b] > 2 else bonus[b]
            joint[path_tok[b, 1], t2] += weights[b]
    assert (joint - exact_joint(P)).abs().max() < EXACT
    assert choose_rule(tree, 0.7, mode="naive") == "naive"


# ---------------------------------------------------------------- verify() itself


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-walk", "tables"])
@pytest.mark.parametrize("rule", ["without_replacement", "iid", "one_hot", "naive"])
def test_verify_samples_the_target_law_chi_square(rule, compiled, monkeypatch):
    """200k rows verified at once: the first emitted token's counts fit p (threshold p-value > 1e-3,
    fixed seed), and for the without-replacement rule the base-q variant is rejected (< 1e-6).
    Both the compiled CPU walk and the tables every other device uses."""
    monkeypatch.setattr(verify_module, "COMPILED_ON_CPU", compiled)
    V, m, B = 6, 3, 200_000
    g = torch.Generator().manual_seed(7)
    p, q = dirichlet(V, g, zeros=1), dirichlet(V, g)
    logits = p.float().log().expand(B, m + 1, V)
    wr = rule == "iid"
    if rule == "one_hot":
        draws = torch.tensor([4, 1, 4]).expand(B, m)
        kw = {}
    else:
        gq = torch.Generator().manual_seed(8)
        if wr:
            draws = torch.multinomial(q.float().expand(B, V), m, replacement=True, generator=gq)
        else:
            u = torch.rand(B, V, generator=gq)
            draws = torch.topk(q.float().log() - (-u.log()).log(), m).indices
        kw = dict(child_ids=torch.arange(V).expand(B, m + 1, V), child_probs=q.float().expand(B, m + 1, V),
                  with_replacement=wr)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), draws], 1)
    tree = TokenTree(TreeShape.full(m, 1).parents_tensor(), tokens, **kw)
    mode = "naive" if rule == "naive" else "auto"
    assert choose_rule(tree, 1.0, mode) == rule
    res = verify(tree, logits, temperature=1.0, generator=torch.Generator().manual_seed(9), mode=mode)
    first = torch.where(res.num_accepted > 1, tokens.gather(1, res.accepted[:, 1:2])[:, 0], res.bonus)
    _, _, pvalue = chi_square(torch.bincount(first, minlength=V), p)
    assert pvalue > 1e-3
    if rule == "without_replacement":
        wrong = TokenTree(tree.parents, tokens, child_ids=tree.child_ids, child_probs=tree.child_probs,
                          with_replacement=True)
        res = verify(wrong, logits, temperature=1.0, generator=torch.Generator().manual_seed(9))
        first = torch.where(res.num_accepted > 1, tokens.gather(1, res.accepted[:, 1:2])[:, 0], res.bonus)
        assert chi_square(torch.bincount(first, minlength=V), p)[2] < 1e-6


def greedy_walk(parents, tokens, valid, logits):
    """The definition: from the root, move to the first valid child equal to the argmax."""
    node, path = 0, [0]
    while True:
        best = int(torch.argmax(logits[node]))
        nxt = [c for c in range(len(parents)) if parents[c] == node and valid[c] and tokens[c] == best]
        if not nxt:
            return path, best
        node = nxt[0]
        path.append(node)


def test_greedy_follows_the_argmax_path_per_row():
    g = torch.Generator().manual_seed(0)
    V, B = 4, 64
    shape = TreeShape.paper13()
    parents = shape.parents_tensor()
    tokens = torch.randint(0, V, (B, shape.n), generator=g)
    valid = torch.rand(B, shape.n, generator=g) > 0.2
    valid[:, 0] = True
    logits = torch.randn(B, shape.n, V, generator=g)
    res = verify(TokenTree(parents, tokens, valid), logits)
    longest = 0
    for b in range(B):
        path, bonus = greedy_walk(shape.parents, tokens[b].tolist(), valid[b].tolist(), logits[b])
        assert res.accepted[b, : len(path)].tolist() == path and int(res.num_accepted[b]) == len(path)
        assert bool((res.accepted[b, len(path):] == 0).all()) and int(res.bonus[b]) == bonus
        assert all(valid[b, i] for i in path)
        longest = max(longest, len(path))
    assert longest >= 3  # deep acceptances were exercised


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("rule", ["one_hot", "iid", "without_replacement", "naive"])
def test_greedy_rows_among_sampled_ones_follow_the_argmax_path_under_every_rule(rule, compiled, monkeypatch):
    """Rows of per-row values, two in three greedy: whatever rule the tree's drafts call for, the
    greedy rows accept and emit exactly what greedy verification of them does (the one-hot law of
    the argmax), by the compiled walk and by the tables other devices use; siblings carry distinct
    tokens, as drafts without replacement do."""
    monkeypatch.setattr(verify_module, "COMPILED_ON_CPU", compiled)
    g = torch.Generator().manual_seed(1)
    V, B = 6, 48
    shape = TreeShape.paper13()
    tokens = torch.zeros(B, shape.n, dtype=torch.long)
    for b in range(B):
        for node in range(shape.n):
            kids = [c for c in range(1, shape.n) if shape.parents[c] == node]
            tokens[b, kids] = torch.randperm(V, generator=g)[: len(kids)]
    valid = torch.rand(B, shape.n, generator=g) > 0.2
    valid[:, 0] = True
    logits = torch.randn(B, shape.n, V, generator=g) * 2
    laws = {}
    if rule in ("iid", "without_replacement"):
        laws = dict(child_ids=torch.arange(V).expand(B, shape.n, V).clone(), with_replacement=rule == "iid",
                    child_probs=torch.distributions.Dirichlet(torch.ones(V)).sample((B, shape.n)).double())
    tree = TokenTree(shape.parents_tensor(), tokens, valid, **laws)
    mode = "naive" if rule == "naive" else "auto"
    params = SamplingParams.stack([SamplingParams(0.0, mode=mode) if b % 3 else SamplingParams(0.9, 3, mode=mode)
                                   for b in range(B)])
    assert choose_rule(tree, params.temperature, params.mode) == rule
    want = verify(tree, logits)
    got = verify(tree, logits, params, generator=torch.Generator().manual_seed(2))
    greedy = [b for b in range(B) if b % 3]
    assert torch.equal(got.accepted[greedy], want.accepted[greedy])
    assert torch.equal(got.num_accepted[greedy], want.num_accepted[greedy])
    assert torch.equal(got.bonus[greedy], want.bonus[greedy])
    assert int(want.num_accepted[greedy].max()) >= 3  # (deep acceptances were exercised)


def test_process_logits_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=torch.float16)
    p = process_logits(logits, 0.5)
    assert p.dtype == torch.float32
    assert torch.allclose(p, torch.softmax(logits.float() / 0.5, -1))
    p = process_logits(logits, 1.0, top_k=2)
    assert torch.allclose(p[0, :2], torch.softmax(torch.tensor([2.0, 1.0]), -1)) and p[0, 2:].sum() == 0
    full = torch.softmax(logits.float(), -1)[0]  # sorted mass: .50 .18 .11 .07 .03 (approx.)
    p = process_logits(logits, 1.0, top_p=0.6)
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(p[0, :2], full[:2] / full[:2].sum())
    p = process_logits(logits, 1.0, top_p=0.01)  # the most likely token always survives
    assert p[0].tolist() == [1.0, 0, 0, 0, 0]


def test_sample_tokens_greedy_and_seeded():
    logits = torch.randn(5, 9)
    assert sample_tokens(logits).tolist() == logits.argmax(-1).tolist()
    a = sample_tokens(logits, 1.0, generator=torch.Generator().manual_seed(3))
    b = sample_tokens(logits, 1.0, generator=torch.Generator().manual_seed(3))
    assert a.tolist() == b.tolist()


def test_bad_inputs():
    tree = TokenTree(TreeShape.chain(2).parents_tensor(), torch.tensor([[0, 1, 2]]))
    logits = torch.randn(1, 3, 5)
    with pytest.raises(ValueError, match="logits must have shape"):
        verify(tree, torch.randn(1, 4, 5))
    with pytest.raises(ValueError, match=r"tree.tokens\[0, 2\] = 7 is outside the vocabulary"):
        verify(TokenTree(tree.parents, torch.tensor([[0, 1, 7]])), logits)
    with pytest.raises(ValueError, match="temperature"):
        verify(tree, logits, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        verify(tree, logits, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        verify(tree, logits, temperature=1.0, top_k=-2)
    with pytest.raises(ValueError, match="mode"):
        verify(tree, logits, temperature=1.0, mode="exact")
    bad_ids = TokenTree(tree.parents, tree.tokens, child_ids=torch.full((1, 3, 2), 9),
                        child_probs=torch.ones(1, 3, 2))
    with pytest.raises(ValueError, match="child_ids"):
        verify(bad_ids, logits, temperature=1.0)


@pytest.mark.parametrize("with_replacement", [True, False])
def test_a_draft_its_declared_law_cannot_produce_is_never_accepted(with_replacement):
    q = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    p = torch.tensor([0.1, 0.1, 0.7, 0.1], dtype=torch.float64)
    tree = one_node_tree([2, 0, 0], q, with_replacement)  # 2 has q = 0; the second 0 repeats a draw
    accept, residual = acceptance_tables(tree, p.expand(1, 4, 4).clone(), "iid" if with_replacement else "without_replacement")
    assert accept[0, 1] == 0
    if not with_replacement:
        assert accept[0, 3] == 0  # without replacement a repeated token has conditional q = 0


@settings(max_examples=60, deadline=None)
@given(trees(max_n=24), st.sampled_from(["one_hot", "iid", "without_replacement"]), st.integers(0, 2**31 - 1))
def test_the_compiled_walk_is_the_tables_walk(tree_and_batch, rule, seed):
    """Random trees (per-row parents too), invalid nodes, repeated drafts and ids outside a
    node's law: with the same coins the compiled CPU walk accepts the same path, and the residual
    it hands the bonus draw is the tables' at the last node."""
    from stree.sampling.verify import _walk, _walk_compiled

    parents, B = tree_and_batch
    n, V = parents.shape[-1], 5
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, n), generator=g)
    valid = torch.rand(B, n, generator=g) > 0.25
    valid[:, 0] = True
    kw = {}
    if rule != "one_hot":
        kw = dict(child_ids=torch.randint(0, V, (B, n, 3), generator=g), child_probs=torch.rand(B, n, 3, generator=g),
                  with_replacement=rule == "iid")
    tree = TokenTree(parents, tokens, valid=valid, **kw)
    probs = torch.softmax(3 * torch.randn(B, n, V, generator=g, dtype=torch.float64), -1)
    probs[torch.rand(B, n, V, generator=g) < 0.2] = 0.0  # zero entries: rejections with no mass left
    probs[..., 0] += 1e-3
    probs = (probs / probs.sum(-1, keepdim=True)).float()
    coins = torch.rand(B, n, generator=g)
    accept, residual = acceptance_tables(tree, probs, rule)
    depth = int(tree.index.depth.max())
    path, num, end = _walk(tree.parents.expand(B, n), coins < accept, depth)
    c_path, c_num, c_last = _walk_compiled(tree, probs, rule, coins)
    assert torch.equal(c_path, path) and torch.equal(c_num, num)
    torch.testing.assert_close(c_last, residual[torch.arange(B), end], atol=1e-5, rtol=1e-4)


def _drafted(tree_and_batch, masked: bool, seed: int, V: int):
    """A tree of random drafts among ``V`` tokens (repeats among siblings likely), with invalid
    nodes where ``masked``; and the generator, to draw more."""
    parents, B = tree_and_batch
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, parents.shape[-1]), generator=g)
    valid = None
    if masked:
        valid = torch.rand(tokens.shape, generator=g) > 0.25
        valid[:, 0] = True
    return TokenTree(parents, tokens, valid=valid), g, V


@settings(max_examples=80, deadline=None)
@given(trees(max_n=24), st.booleans(), st.integers(0, 2**31 - 1))
def test_the_compiled_greedy_walk_is_the_tensor_walk(tree_and_batch, masked, seed):
    """Random trees (per-row parents too), invalid nodes, repeated drafts among siblings, and
    choices that match several children: the compiled CPU walk of the greedy and naive rules
    takes the same path, length and bonus as :func:`greedy_path`, which CUDA and compiled passes
    run."""
    from stree.sampling.verify import _follow_compiled, _max_depth, greedy_path

    tree, g, V = _drafted(tree_and_batch, masked, seed, 3)
    B, n = tree.tokens.shape
    tokens, valid = tree.tokens, tree.valid
    choice = torch.randint(0, V, (B, n), generator=g)
    want = greedy_path(tree.parents, tokens, valid, choice, _max_depth(tree))
    got = _follow_compiled(tree, choice)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@settings(max_examples=80, deadline=None)
@given(trees(max_n=24), st.booleans(), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**31 - 1))
def test_greedy_verification_on_the_host_is_the_tensor_path(tree_and_batch, masked, dtype, seed):
    """The CPU's one-pass greedy verification (argmax at the path's nodes only, finiteness, the
    emitted tokens) against the tensor path a device runs: :func:`verify` with the compiled paths
    off, the step's emitted tokens and its finiteness check. Random trees (per-row parents too),
    invalid nodes, logits with tied maxima (small integers: the first maximum wins in both), and
    NaN, +inf and -inf planted in some rows; half logits widened."""
    from stree.decoding.steps import _emitted, _finite
    from stree.sampling.verify import greedy_rows_host, verify_greedy_host

    tree, g, V = _drafted(tree_and_batch, masked, seed, 5)
    (B, n), tokens = tree.tokens.shape, tree.tokens
    logits = torch.randint(-2, 3, (B, n, V), generator=g).to(dtype)
    for row, bad in zip(range(B), (float("nan"), float("inf"), -float("inf"))):
        if torch.rand(1, generator=g) < 0.5:
            logits[row, int(torch.randint(0, n, (1,), generator=g)), int(torch.randint(0, V, (1,), generator=g))] = bad
    result, emitted, finite = verify_greedy_host(tree, logits)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify_module, "COMPILED_ON_CPU", False)
        want = verify(tree, logits.float(), SamplingParams(0.0), validate=False)
    flags = _finite(logits.float(), SamplingParams(0.0))[0].all(1)
    assert torch.equal(finite, flags)
    ok = flags.tolist()  # (a row holding NaN: the tensor argmax takes the NaN; the decoding step raises there)
    for a, b in ((result.accepted, want.accepted), (result.num_accepted, want.num_accepted),
                 (result.bonus, want.bonus), (emitted, _emitted(tokens, want.accepted, want.num_accepted, want.bonus))):
        assert a.dtype == b.dtype and torch.equal(a[ok], b[ok])
    rows, row_finite = greedy_rows_host(logits[:, 0])
    assert rows.shape == (B, 1)
    rows = rows[:, 0]
    assert torch.equal(row_finite, _finite(logits[:, 0].float(), SamplingParams(0.0))[0])
    assert torch.equal(rows[row_finite], logits[:, 0].float().argmax(-1)[row_finite])


def test_draw_samples_each_rows_law_and_never_an_entry_of_zero(monkeypatch):
    """The one-index-per-row draw every sampled token goes through (a plain step, the bonus, the
    naive rule): each row's counts against its law by chi-square (fixed seed, p > 1e-3), no draw
    where the law is 0, and rows of unnormalised weights drawn alike; a uniform at the top of its
    range draws the last positive entry, never one past it."""
    g = torch.Generator().manual_seed(0)
    laws = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [0.7, 0.0, 0.1, 0.0, 0.0, 0.2]])
    n = 20000
    got = draw(torch.cat([laws.repeat(n, 1), 3 * laws.repeat(n, 1)]), g).view(2, n, 2)
    for scale in range(2):
        for r in range(2):
            counts = torch.bincount(got[scale, :, r], minlength=6)
            assert counts[laws[r] == 0].sum() == 0
            assert chi_square(counts, laws[r])[2] > 1e-3
    monkeypatch.setattr(torch, "rand", lambda shape, **_: torch.full(shape, 1 - 2 ** -53, dtype=torch.float64))
    assert draw(laws, g).tolist() == [4, 5]  # every uniform at its largest: the last positive entries, never past
