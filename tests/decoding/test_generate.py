"""The decoding loop end to end: greedy token identity with autoregressive decoding on tiny models of
both families, sampling laws by chi-square against exact enumeration, row finishing, stats, errors."""

import pytest
import torch
from tiny_models import FAMILIES, mamba2

from stree.drafters import Drafter, NGramDrafter
from stree.decoding.loop import generate
from stree.testing import MarkovDrafter, MarkovLM, cell_counts, chi_square, two_token_law
from stree.tree import TokenTree, TreeShape

SEEDED_P = 1e-3  # fixed seeds, so each chi-square test is deterministic; correct code passes this
WRONG_P = 1e-6  # and a known-wrong rule must fall below this


def looping_prompts(n, vocab, seed):
    """Prompts with repeats in them (so the n-gram drafter has matches) of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        motif = torch.randint(0, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        tail = torch.randint(0, vocab, (i % 4,), generator=g).tolist()
        prompts.append(motif * (1 + i % 3) + tail)
    return prompts


TREES = {"chain4": ("chain", TreeShape.chain(4)), "chain4-as-tree": ("stree", TreeShape.chain(4)),
         "paper13": ("stree", TreeShape.paper13()), "binary3": ("stree", TreeShape.full(2, 3))}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_decoding_is_token_identical_to_autoregressive(family):
    model = FAMILIES[family]()
    prompts = looping_prompts(21, model.vocab_size, seed=1)
    kw = dict(max_new_tokens=20, eos_token_id=None)
    accepted = 0
    for batch in ([prompts[0]], [prompts[1]], *[prompts[i: i + 3] for i in range(2, 21, 3)]):
        ref = generate(model, batch, method="autoregressive", **kw)
        assert all(len(s) == 20 for s in ref.new_tokens)
        for name, (method, shape) in TREES.items():
            out = generate(model, batch, method=method, tree=shape, drafter=NGramDrafter(), **kw)
            assert out.sequences == ref.sequences, (name, batch)
            accepted += sum(map(sum, out.stats.accepted))
    assert accepted > 100  # drafts were accepted often, so accepted paths (not just bonuses) were checked


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_through_the_triton_kernels(family, device):
    """The same loop with every kernel forced to Triton (the interpreter here, CUDA on a GPU)."""
    model = FAMILIES[family]()
    prompts = looping_prompts(2, model.vocab_size, seed=3)
    ref = generate(model, prompts, method="autoregressive", max_new_tokens=8)
    model.to(device).kernel_backend = "triton"
    out = generate(model, prompts, tree=TreeShape.paper13(), max_new_tokens=8)
    assert out.sequences == ref.sequences


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_stop_at_eos_and_max_tokens_independently(family):
    model = FAMILIES[family]()
    prompts = looping_prompts(3, model.vocab_size, seed=5)
    ref = generate(model, prompts, method="autoregressive", max_new_tokens=16)
    eos = ref.new_tokens[1][5]  # row 1 reaches it at step 6 (or earlier)
    ref_eos = generate(model, prompts, method="autoregressive", max_new_tokens=16, eos_token_id=eos)
    out = generate(model, prompts, tree=TreeShape.full(2, 3), max_new_tokens=16, eos_token_id=[eos])
    assert out.sequences == ref_eos.sequences
    for row, full in zip(out.new_tokens, ref.new_tokens):
        cut = full.index(eos) + 1 if eos in full else 16
        assert row == full[:cut]  # nothing past the first EOS, nothing past max_new_tokens
    assert len(out.new_tokens[1]) <= 6 and out.stats.new_tokens == [len(r) for r in out.new_tokens]


def test_eos_inside_an_accepted_run_ends_the_row_there():
    """Greedy cycle 0 -> 1 -> 2 -> 3 -> 0 that the n-gram drafter predicts in full: the verifier
    accepts drafts past the EOS, and the loop must still stop right after it."""
    table = torch.full((4, 4), 0.02, dtype=torch.float64)
    table[torch.arange(4), (torch.arange(4) + 1) % 4] = 0.94
    model = MarkovLM(table)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0]
    out = generate(model, [prompt, prompt[:-1]], tree=TreeShape.chain(6), max_new_tokens=10, eos_token_id=2)
    assert out.new_tokens == [[1, 2], [0, 1, 2]]
    assert out.stats.accepted[0][0] >= 3  # EOS was mid-run among the accepted drafts


def markov(order, V, seed):
    torch.manual_seed(seed)  # Dirichlet draws from the global generator
    g = torch.Generator().manual_seed(seed)
    table = torch.distributions.Dirichlet(torch.full((V,), 0.7, dtype=torch.float64)).sample((V,) * order)
    q = torch.distributions.Dirichlet(torch.ones(V)).sample((V,))  # a mismatched draft table
    return MarkovLM(table), q, g


class FlippedDeclaration(MarkovDrafter):
    """Draws without replacement but declares i.i.d. draws: the base-q residual bug."""

    def propose(self, context, shape):
        t = super().propose(context, shape)
        return TokenTree(t.parents, t.tokens, t.valid, t.child_ids, t.child_probs, with_replacement=True)


RULE_CASES = {
    "without_replacement/seed0": dict(drafter="wor", seed=0),
    "without_replacement/seed1": dict(drafter="wor", seed=1),
    "without_replacement/seed2": dict(drafter="wor", seed=2),
    "iid": dict(drafter="iid", seed=0),
    "one_hot": dict(drafter="ngram", seed=0),
    "naive": dict(drafter="ngram", seed=0, mode="naive"),
    "naive-stochastic-drafts": dict(drafter="wor", seed=0, mode="naive"),
}


@pytest.mark.parametrize("case", RULE_CASES)
def test_markov_lm_decoding_samples_the_exact_joint_law(case):
    """40k rows (20k with the Python n-gram drafter) decoded at once from an order-2 Markov table
    (V = 5) with tree drafts: the joint of the first 3 tokens fits the exact law by chi-square."""
    spec = RULE_CASES[case]
    model, q, _ = markov(order=2, V=5, seed=3)
    drafter = {"wor": lambda: MarkovDrafter(q, seed=spec["seed"] + 10),
               "iid": lambda: MarkovDrafter(q, with_replacement=True, seed=spec["seed"] + 10),
               "ngram": NGramDrafter}[spec["drafter"]]()
    prompt = [1, 2, 1, 2, 0, 1, 2, 1]
    B = 20_000 if spec["drafter"] == "ngram" else 40_000
    out = generate(model, [prompt] * B, drafter=drafter, tree=TreeShape.full(3, 2), max_new_tokens=3,
                   temperature=1.0, seed=spec["seed"], mode=spec.get("mode", "auto"))
    first_step = torch.tensor([a[0] for a in out.stats.accepted], dtype=torch.float)
    assert first_step.mean() > 0.05  # the tree's verification decided thousands of tokens 2 and 3
    _, _, pvalue = chi_square(cell_counts(torch.tensor(out.new_tokens), 5), model.joint_law(prompt, 3))
    assert pvalue > SEEDED_P, pvalue


def test_markov_chi_square_detects_the_base_q_bug():
    model, q, _ = markov(order=2, V=5, seed=3)
    prompt = [1, 2, 1, 2, 0, 1, 2, 1]
    out = generate(model, [prompt] * 40_000, drafter=FlippedDeclaration(q, seed=10), tree=TreeShape.full(3, 2),
                   max_new_tokens=3, temperature=1.0, seed=0)
    assert chi_square(cell_counts(torch.tensor(out.new_tokens), 5), model.joint_law(prompt, 3))[2] < WRONG_P


def test_tiny_mamba2_sampling_matches_the_enumerated_law():
    """Temperature 0.9, top-p 0.95, stochastic paper13 drafts: the first 2 generated tokens of 12k
    rows against the exact law from the model's own prefill/step distributions."""
    model = mamba2(vocab_size=6, pad_vocab_size_multiple=1, seed=2)
    with torch.no_grad():  # flatter logits: a tiny random model is otherwise near-deterministic
        model.backbone.norm_f.weight.mul_(0.1)
    V = model.vocab_size
    prompt = [1, 4, 2, 5, 3]
    kw = dict(temperature=0.9, top_p=0.95)
    p1, p2 = two_token_law(model, prompt, **kw)
    joint = p1[:, None] * p2
    # drafts close to (not equal to) the target, so most second tokens are accepted drafts
    torch.manual_seed(0)
    q = 0.7 * p2.float() + 0.3 * torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    out = generate(model, [prompt] * 12_000, drafter=MarkovDrafter(q, seed=4), tree=TreeShape.paper13(),
                   max_new_tokens=2, seed=5, **kw)
    accepted = torch.tensor([a[0] for a in out.stats.accepted], dtype=torch.float)
    assert accepted.mean() > 0.5
    _, _, pvalue = chi_square(cell_counts(torch.tensor(out.new_tokens), V), joint)
    assert pvalue > SEEDED_P, pvalue


def test_same_seed_same_output_and_stats():
    model, q, _ = markov(order=1, V=6, seed=0)
    prompts = [[1, 2, 3], [4], [0, 0, 5, 1]]
    kw = dict(drafter=MarkovDrafter(q), max_new_tokens=30, temperature=1.0, top_k=4)
    a = generate(model, prompts, seed=7, **kw)
    kw["drafter"] = MarkovDrafter(q)
    b = generate(model, prompts, seed=7, **kw)
    kw["drafter"] = MarkovDrafter(q)
    c = generate(model, prompts, seed=8, **kw)
    assert a.sequences == b.sequences and a.sequences != c.sequences
    s = a.stats
    assert s.new_tokens == [30, 30, 30]
    # per row: 1 token from the prefill, then (accepted + 1) per step
    assert all(1 + sum(acc[:-1]) + len(acc) - 1 < 30 <= 1 + sum(acc) + len(acc) for acc in s.accepted)
    assert s.target_forwards == max(map(len, s.accepted))
    assert s.tau == pytest.approx(87 / sum(map(len, s.accepted)))
    assert s.time_total >= s.time_draft + s.time_verify + s.time_commit + s.time_prefill and s.time_other >= 0
    assert s.tokens_per_s > 0 and "tau" in s.summary()
    ar = generate(model, prompts, method="autoregressive", max_new_tokens=30, seed=7)
    assert ar.stats.tau == 1.0 and ar.stats.target_forwards == 29


class OutOfVocab(Drafter):
    def __init__(self, vocab):
        self.vocab = vocab

    def propose(self, context, shape):
        tokens = torch.full((len(context), shape.n), self.vocab)
        tokens[:, 0] = context.last_tokens()
        return TokenTree(shape.parents_tensor(), tokens)


class WrongRoot(Drafter):
    def propose(self, context, shape):
        return TokenTree(shape.parents_tensor(), (context.last_tokens()[:, None] + 1) % 7 * torch.ones(1, shape.n, dtype=torch.long))


def test_bad_inputs_name_the_argument():
    model = mamba2()
    V = model.vocab_size
    with pytest.raises(ValueError, match="input_ids row 1 is empty"):
        generate(model, [[1, 2], []], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"max_length 10 is too small.*needs 13"):
        generate(model, [[1] * 6], max_new_tokens=3, max_length=10, tree=TreeShape.paper13())  # 6 + 3 + depth 4
    # tree="auto" plans within the room left (none here: plain steps), never past it
    assert generate(model, [[1] * 6], max_new_tokens=4, max_length=10).stats.trees.keys() == {1}
    with pytest.raises(ValueError, match=rf"tree.tokens\[0, 1\] = {V} is outside the vocabulary"):
        generate(model, [[1, 2, 3]], drafter=OutOfVocab(V), max_new_tokens=5)
    with pytest.raises(ValueError, match="root token"):
        generate(model, [[1, 2, 3]], drafter=WrongRoot(), max_new_tokens=5)
    with pytest.raises(ValueError, match="method"):
        generate(model, [[1]], method="beam", max_new_tokens=3)
    with pytest.raises(ValueError, match="needs a chain tree"):
        generate(model, [[1]], method="chain", tree=TreeShape.paper13(), max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1]], max_new_tokens=2, temperature=1.0, top_p=1.5)
    # the model's own guards: a prompt longer than the cache, a tree deeper than the room left
    cache = model.allocate_cache(1, 8)
    with pytest.raises(ValueError, match="past the cache's max_length 8"):
        model.prefill(torch.ones(1, 9, dtype=torch.long), cache)
    model.prefill(torch.ones(1, 5, dtype=torch.long), cache)
    deep = TokenTree.from_shape(TreeShape.chain(3), torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="would reach 9 tokens, past the cache's max_length 8"):
        model.forward_tree(deep, cache)


def test_only_a_speculative_loops_plain_steps_follow_the_tree_passes_weights(monkeypatch):
    """A speculative loop's tree passes run inside models.layers.linear.leading, and its plain
    steps inside following (they read the weight copies the passes use) for FOLLOW_WIDE steps
    after a pass, no more (a step multiplies each weight once: past them following has nothing
    left to follow, and its lookups cost each product); autoregressive decoding enters neither."""
    import contextlib

    import stree.decoding.loop as gen
    import stree.models.layers.linear as lin
    from stree.decoding.autotree import AutoTree
    from stree.decoding.cost import CostProfile

    entered = []

    def counting(role):
        @contextlib.contextmanager
        def block():
            entered.append(role)
            yield
        return block

    def plain(*args, **kwargs):
        entered.append("plain")
        return step(*args, **kwargs)

    step = gen.autoregressive_step
    monkeypatch.setattr(gen, "following", counting("follow"))
    monkeypatch.setattr(gen, "leading", counting("lead"))
    monkeypatch.setattr(gen, "autoregressive_step", plain)
    monkeypatch.setattr(lin, "FOLLOW_WIDE", 2)
    model = mamba2(seed=0)
    generate(model, [[1, 2, 3, 4]], max_new_tokens=6, method="autoregressive")
    assert set(entered) == {"plain"}
    entered.clear()

    class EveryFourth(NGramDrafter):  # (plain steps right after a pass and past FOLLOW_WIDE, whatever is accepted)
        calls = 0

        def can_draft(self, context):
            self.calls += 1
            return self.calls % 4 == 1 and super().can_draft(context)

    cheap = AutoTree(CostProfile(1.0, (2, 4), (1.0, 1.0)))  # trees where the n-gram drafts, else plain steps
    generate(model, [[1, 2, 3, 1, 2, 3, 1, 2]], max_new_tokens=24, drafter=EveryFourth(), tree=cheap)
    since, followed = None, []  # plain steps since the last pass (None: no pass yet)
    for i, role in enumerate(entered):
        if role == "lead":
            since = 0
        elif role == "plain":
            followed.append(i > 0 and entered[i - 1] == "follow")
            assert followed[-1] == (since is not None and since < lin.FOLLOW_WIDE), entered
            since = None if since is None else since + 1
    assert True in followed and False in followed and entered.count("lead") > 1  # both kinds of plain step met
    entered.clear()
    out = generate(model, [[1, 2, 3, 4]], max_new_tokens=6, drafter=NGramDrafter(), tree=TreeShape.chain(2))
    assert len(entered) == out.stats.target_forwards and set(entered) == {"lead"}  # every step a tree pass


@pytest.mark.parametrize("method", ["autoregressive", "stree"])
@pytest.mark.parametrize("torch_compile", [False, True])
def test_a_product_path_that_won_its_trial_is_taken_where_a_call_starts_not_inside_one(monkeypatch, method,
                                                                                        torch_compile):
    """A challenger that won its trial in use (stree.models.layers.linear._Trial) is taken by the next
    decoding call at its start: every product inside a call keeps one path."""
    import stree.models.layers.linear as lin

    model = mamba2(seed=0)
    key = (1, *model.lm_head.weight.shape, False)
    generate(model, [[1, 2, 3]], max_new_tokens=2, method=method, torch_compile=torch_compile)  # (measured)
    monkeypatch.setitem(lin._FASTEST, key, "blas")
    monkeypatch.setattr(lin, "_WON", {key: "transposed"})
    real, seen = lin.settle, []
    monkeypatch.setattr(lin, "settle", lambda: seen.append(dict(lin._WON)) or real())
    generate(model, [[1, 2, 3]], max_new_tokens=2, method=method, torch_compile=torch_compile)
    assert seen[0] == {key: "transposed"} and lin._FASTEST[key] == "transposed" and key not in lin._WON


@pytest.mark.parametrize("tree", ["auto", "paper13", "plain"])
def test_an_eager_call_measures_its_products_before_decoding(monkeypatch, tree):
    """An eager CPU call times the product choices of every row count its steps and trees may
    multiply (the batch times 1 to the most nodes) in its setup, and none after its prefill: a tree
    size first used mid-call had paid its timing inside a timed step (at batch 8, a few percent of
    the call; an explicit tree's first pass, fifteen plain steps' time). With ``tree="auto"`` the
    machine's costs are known first (a new process reads them from the cache file without
    multiplying anything; here the choice's costs are given); an explicit tree's shape, and plain
    decoding's step, say their rows themselves."""
    import stree.models.layers.linear as lin
    from stree.decoding.loop import decode, drain
    from stree.decoding.autotree import AutoTree
    from stree.decoding.cost import CostProfile

    model = mamba2(seed=0)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5]]
    timed = []
    real = lin._fastest
    monkeypatch.setattr(lin, "PATH", "auto")
    monkeypatch.setattr(lin, "_FASTEST", {})  # a process that has multiplied nothing
    monkeypatch.setattr(lin, "_fastest", lambda paths, *best: timed.append(1) or real(paths, *best))
    if tree == "auto":
        # costs where trees win whatever this machine's clock says (a measured profile under load chose
        # plain steps only, and there was no tree whose products to have timed)
        kw = dict(drafter=NGramDrafter(), tree=AutoTree(CostProfile(1.0, (2, 4, 8, 16), (1.0, 1.0, 1.05, 1.1))))
    elif tree == "paper13":
        kw = dict(drafter=NGramDrafter(), tree=TreeShape.paper13())
    else:
        kw = dict(method="autoregressive")
    steps = decode(model, prompts, max_new_tokens=24, **kw)
    next(steps)  # the setup and the prefill
    before = len(timed)
    out = drain(steps)
    assert before > 0 and len(timed) == before
    if tree != "plain":  # trees were verified: their products were timed before
        assert any(n > 1 for n in out.stats.trees)
    assert out.stats.time_setup > 0


@pytest.mark.parametrize("path", ["one call", "block by block"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_greedy_identity_with_steps_and_tree_passes_on_different_products(monkeypatch, dtype, path):
    """The shipped target in half precision (float16 is its checkpoint's dtype, the README's
    default). Block by block: plain steps on PyTorch's own half products, tree passes on the float32
    copies (stree.models.layers.linear, as a CPU without float16 arithmetic measures it). One call
    (stree.models.fused_step, where the CPU library is built): float32 rounded where the blocks round,
    a tree's scan summing in another order than a step's state update.

    float16: greedy output token for token autoregressive decoding's. bfloat16 keeps 8 bits of
    mantissa: a tree pass and a step round differently, and a near-tie between two logits one
    bfloat16 step apart can go either way (seen on the H200 machine's CPU, and here with either
    product pinned, and in one call: 1-2 of 24 prompts). There every token emitted is within two
    bfloat16 steps of the best logit that a full forward over the output gives its position."""
    import stree.models.layers.linear as lin
    from stree.kernels.cpu import mamba_step
    from tiny_models import count_calls, layer_by_layer

    if path == "one call" and not mamba_step.available():
        pytest.skip("no C++ compiler for the CPU library here")
    if path == "block by block":
        layer_by_layer(monkeypatch)
    calls = count_calls(monkeypatch, mamba_step.MambaStep, "tree_greedy")
    from stree.models import load
    from stree.tools.demo import TARGET, read_prompts
    from stree.checkpoints.tokenizer import load_tokenizer

    class RowsDecide(dict):  # the measured choice, fixed: one row on its own product, several on the copy
        def get(self, key, default=None):
            return key[0] > 1

    monkeypatch.setattr(lin, "PATH", "auto")
    monkeypatch.setattr(lin, "_WIDER", RowsDecide())
    model = load(TARGET, dtype=dtype)
    tokenizer = load_tokenizer(TARGET, vocab_size=model.vocab_size)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in read_prompts(TARGET / "prompts.jsonl", 3)]
    kw = dict(max_new_tokens=64, eos_token_id=None)
    accepted = 0
    for batch in ([prompts[0]], prompts[1:]):
        ref = generate(model, batch, method="autoregressive", **kw)
        out = generate(model, batch, tree=TreeShape.paper13(), drafter=NGramDrafter(), **kw)
        if dtype == torch.float16:
            assert out.sequences == ref.sequences
        for row, prompt in zip(out.sequences, batch):  # every token near the best of a full forward's logits
            with torch.no_grad():
                logits = model(torch.tensor([row[:-1]]))[0, len(prompt) - 1:].float()
            emitted = logits.gather(1, torch.tensor(row[len(prompt):])[:, None])[:, 0]
            best = logits.max(1).values
            assert (best - emitted <= 2 * torch.finfo(dtype).eps * best.abs()).all(), (best - emitted).max()
        accepted += sum(map(sum, out.stats.accepted))
    assert accepted > 20  # accepted paths were checked, not only bonuses
    assert any(id(p) in lin._WIDE for p in model.parameters())  # the tree passes took the float32 copies
    assert (calls[0] > 0) == (path == "one call")


def test_a_drafter_whose_observe_learns_nothing_is_shown_nothing(monkeypatch):
    """The n-gram drafter reads its context as it drafts and keeps the base's ``observe``, which learns
    nothing: the loop builds nothing to show it (``Drafter.observes``), and its output is still plain
    decoding's. A drafter with an ``observe`` of its own (STAND's, or a spy set on the instance) is
    shown every token."""
    from stree.decoding.rows import Rows
    from stree.drafters.registry import make_drafter

    model = mamba2()
    prompt = [[1, 2, 3, 1, 2, 3, 1, 2]]
    plain = generate(model, prompt, max_new_tokens=40, method="autoregressive")
    shown, emit = [], Rows.emit
    monkeypatch.setattr(Rows, "emit", lambda self, step, drafter, k=None: shown.append(drafter) or emit(self, step,
                                                                                                        drafter, k))
    ngram = NGramDrafter()
    assert not ngram.observes and make_drafter("stand", vocab_size=model.vocab_size).observes
    out = generate(model, prompt, drafter=ngram, tree=TreeShape.chain(3), max_new_tokens=40)
    assert out.sequences == plain.sequences and max(out.stats.trees) > 1 and shown and not any(shown)
    spied, seen = NGramDrafter(), []
    spied.observe = lambda context, tokens, target: seen.extend(tokens[0])
    shown.clear()
    generate(model, prompt, drafter=spied, tree=TreeShape.chain(3), max_new_tokens=40)
    assert spied.observes and all(d is spied for d in shown) and seen == plain.sequences[0][len(prompt[0]):]
