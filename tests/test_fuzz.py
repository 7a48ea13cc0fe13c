"""Fuzzing the public entry points with random trees, random paths and random bad arguments:
each call either gives its documented result or raises ValueError / TypeError, never another
exception, and a refused ``commit`` leaves the cache as it was."""

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from strategies import trees
from tiny_models import VOCAB, hybrid, mamba2

from stree.decoding.loop import Rows, generate
from stree.tree import TokenTree
from stree.sampling.verify import verify

MODELS = {"mamba2": mamba2(), "hybrid": hybrid()}
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _is_root_path(parents: list[int], path: list[int]) -> bool:
    return (bool(path) and all(0 <= v < len(parents) for v in path) and path[0] == 0
            and all(parents[b] == a for a, b in zip(path, path[1:])))


@FUZZ
@given(family=st.sampled_from(sorted(MODELS)), tree=trees(max_n=12), data=st.data())
def test_commit_takes_root_paths_and_refuses_everything_else_untouched(family, tree, data):
    model = MODELS[family]
    parents, batch = tree
    n = parents.shape[-1]
    tokens = torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(n))
    cache = model.allocate_cache(batch, 40)
    model.prefill(torch.randint(0, VOCAB, (batch, 5)), cache)
    token_tree = TokenTree(parents, tokens)
    _, tree_pass = model.forward_tree(token_tree, cache)
    rows = parents.expand(batch, n).tolist()
    real = data.draw(st.booleans())  # half the time, real root paths (then junk past num_accepted)
    deepest = int(token_tree.index.depth.max()) + 1
    width = data.draw(st.integers(1, deepest) if real else st.integers(1, n + 1))
    accepted = data.draw(st.lists(st.lists(st.integers(-2, n + 1), min_size=width, max_size=width),
                                  min_size=batch, max_size=batch))
    num = data.draw(st.lists(st.integers(-1, width + 1), min_size=batch, max_size=batch))
    if real:
        for b in range(batch):
            path = [data.draw(st.integers(0, n - 1))]
            while rows[b][path[-1]] >= 0:
                path.append(rows[b][path[-1]])
            path = path[::-1][:width]
            accepted[b][: len(path)], num[b] = path, len(path)
    accepted, num = torch.tensor(accepted), torch.tensor(num)
    valid = width <= int(token_tree.index.depth.max()) + 1 and all(
        1 <= k <= width and _is_root_path(rows[b], accepted[b, :k].tolist()) for b, k in enumerate(num.tolist()))
    before = [t.clone() for t in (cache.conv, cache.ssm, cache.k, cache.v, cache.seqlens) if t is not None]
    try:
        model.commit(cache, tree_pass, accepted, num)
    except ValueError:
        event("refused")
        assert not valid
        after = [t for t in (cache.conv, cache.ssm, cache.k, cache.v, cache.seqlens) if t is not None]
        assert all(torch.equal(a, b) for a, b in zip(before, after))  # refused before any write
        return
    event("committed")
    assert valid and torch.equal(cache.seqlens, before[-1] + num)


BAD_SAMPLING = [dict(temperature=-1.0), dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature="1"),
                dict(top_k=-1), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=math.nan),
                dict(mode="fast")]
GOOD_SAMPLING = [dict(), dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.5, top_p=0.8),
                 dict(temperature=1.0, mode="naive")]


@FUZZ
@given(tree=trees(max_n=10), sampling=st.sampled_from(GOOD_SAMPLING + BAD_SAMPLING), seed=st.integers(0, 1000))
def test_verify_returns_a_valid_path_or_names_the_bad_argument(tree, sampling, seed):
    parents, batch = tree
    n = parents.shape[-1]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, n), generator=g)
    logits = torch.randn(batch, n, VOCAB, generator=g) * 3
    try:
        result = verify(TokenTree(parents, tokens), logits, generator=g, **sampling)
    except (ValueError, TypeError):
        assert sampling in BAD_SAMPLING
        return
    assert sampling in GOOD_SAMPLING
    rows = parents.expand(batch, n).tolist()
    for b in range(batch):
        k = int(result.num_accepted[b])
        path = result.accepted[b, :k].tolist()
        assert 1 <= k <= n and _is_root_path(rows[b], path)
        assert 0 <= int(result.bonus[b]) < VOCAB
        if not sampling.get("temperature"):  # greedy: every accepted draft and the bonus are the argmax
            best = logits[b].argmax(-1)
            assert all(int(tokens[b, c]) == int(best[a]) for a, c in zip(path, path[1:]))
            assert int(result.bonus[b]) == int(best[path[-1]])


BAD_GENERATE = [dict(max_new_tokens=0), dict(max_new_tokens=True), dict(max_new_tokens=2.5), dict(max_new_tokens="3"),
                dict(eos_token_id="a"), dict(eos_token_id=2.5), dict(eos_token_id=-1), dict(eos_token_id=10**6),
                dict(eos_token_id=[1, "b"]), dict(seed=-1), dict(seed=2**70), dict(seed=1.5), dict(method="beam"),
                dict(max_length=3), dict(torch_compile="yes"), dict(cuda_graph=True)] + BAD_SAMPLING
BAD_PROMPTS = [[], [[]], [[10**6]], [[-1]], [["a"]], torch.zeros(1, 3), [[1, 2.5]]]


@FUZZ
@given(family=st.sampled_from(sorted(MODELS)), bad=st.sampled_from(BAD_GENERATE), seed=st.integers(0, 100))
def test_generate_names_every_bad_argument(family, bad, seed):
    with pytest.raises((ValueError, TypeError)):
        generate(MODELS[family], [[1, 2, 3]], **{"max_new_tokens": 4, **bad})


@pytest.mark.parametrize("prompts", BAD_PROMPTS, ids=[repr(p)[:20] for p in BAD_PROMPTS])
def test_generate_names_every_bad_prompt(prompts):
    with pytest.raises((ValueError, TypeError)):
        generate(MODELS["mamba2"], prompts, max_new_tokens=4)


@FUZZ
@given(family=st.sampled_from(sorted(MODELS)), sampling=st.sampled_from(GOOD_SAMPLING),
       prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=3),
       new=st.integers(1, 6), seed=st.integers(0, 100), method=st.sampled_from(["stree", "chain", "autoregressive"]))
def test_generate_on_random_prompts_gives_documented_output(family, sampling, prompts, new, seed, method):
    out = generate(MODELS[family], prompts, max_new_tokens=new, seed=seed, method=method, **sampling)
    assert [s[:len(p)] for s, p in zip(out.sequences, prompts)] == prompts
    assert all(len(t) == new for t in out.new_tokens) and all(0 <= t < VOCAB for s in out.sequences for t in s)


def test_the_token_buffer_grows_as_tokens_come():
    rows = Rows([[1, 2], [3]], [10**12, 10**12], [])
    assert rows.seq.numel() < 10_000  # a limit, not an allocation
    model = MODELS["mamba2"]
    ref = generate(model, [[1, 2, 3], [4]], max_new_tokens=300, method="autoregressive")
    assert generate(model, [[1, 2, 3], [4]], max_new_tokens=300).sequences == ref.sequences  # across two growths
