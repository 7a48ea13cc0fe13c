"""The cost model: profiles interpolate, are measured once per key and cached in a file that is
never trusted when corrupt or made for another key, and measuring leaves the drafter as it was."""

import json

import pytest
import torch
from tiny_models import mamba2

from stree.decoding import cost
from stree.decoding.cost import CostProfile, cost_profile, describe
from stree.drafters import NGramDrafter
from stree.tree import TreeShape


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory and an empty in-process memo."""
    monkeypatch.setenv("STREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_MEMO", {})
    return tmp_path / "costs.json"


def test_profile_interpolates_between_and_past_the_measured_sizes():
    p = CostProfile(2.0, (2, 4, 8), (3.0, 4.0, 8.0), (0.5, 1.0, 1.0))
    assert p.iteration_ms(1) == 2.0 and p.drafting_ms(1) == 0.0  # a plain step
    assert p.iteration_ms(2) == 3.0 and p.iteration_ms(3) == pytest.approx(3.5)
    assert p.iteration_ms(6) == pytest.approx(6.0)
    assert p.iteration_ms(16) == pytest.approx(16.0)  # the last segment's slope, 1 ms a node
    assert p.drafting_ms(3) == pytest.approx(0.75)
    assert p.in_steps(8) == pytest.approx((8.0 + 1.0) / 2.0)
    assert [r["nodes"] for r in describe(p)] == [1, 2, 4, 8]
    assert CostProfile.from_dict(p.to_dict()) == p
    caught = CostProfile(2.0, (2,), (3.0,), catch_ms=0.25)
    assert CostProfile.from_dict(caught.to_dict()) == caught and p.catch_ms == 0.0


def test_a_drafter_models_drafting_is_fitted_by_depth_and_nodes():
    """A drafter model steps once per level: its drafting is a + b depth + c nodes, fitted on the
    measured trees (their depths kept with them), never a negative coefficient."""
    law = lambda n, d: 0.4 + 0.3 * d + 0.02 * n  # noqa: E731
    nodes, depths = (2, 4, 8, 16, 32), (1, 3, 5, 6, 8)
    p = CostProfile(1.0, nodes, (1.0,) * 5, tuple(law(n, d) for n, d in zip(nodes, depths)), 0.1, depths)
    assert p.draft_fit == pytest.approx((0.4, 0.3, 0.02))
    assert p.drafting_ms(16, 15) == pytest.approx(law(16, 15))  # a 16-node chain: twice the bushy tree's
    assert p.drafting_ms(16) == pytest.approx(law(16, 6)) and p.drafting_ms(1, 0) == 0.0
    assert CostProfile.from_dict(p.to_dict()) == p
    falling = CostProfile(1.0, nodes, (1.0,) * 5, (3.0, 2.5, 2.0, 1.6, 1.0), 0.1, depths)
    a, b, c = falling.draft_fit
    assert min(a, b, c) >= 0.0 and all(falling.drafting_ms(n, d) >= 0.0 for n in (2, 64) for d in (1, 30))


@pytest.mark.parametrize("bad", [dict(step_ms=0.0), dict(step_ms=float("nan")), dict(nodes=(4, 2)),
                                 dict(tree_ms=(1.0,)), dict(nodes=(1, 4)), dict(tree_ms=(1.0, -1.0)),
                                 dict(draft_ms=(0.0, float("inf"))), dict(catch_ms=-1.0), dict(catch_ms=float("nan")),
                                 dict(depths=(1,)), dict(depths=(1, 4))])
def test_malformed_profiles_are_refused(bad):
    fields = dict(step_ms=1.0, nodes=(2, 4), tree_ms=(1.5, 2.0), draft_ms=(0.0, 0.0), **{})
    fields.update(bad)
    with pytest.raises(ValueError, match="not a cost profile"):
        CostProfile(**fields)


def counting(monkeypatch):
    """The measurements made, with plausibility off: a burst of other work (CI's other tests) that
    makes a tree cheaper than a step would add one. (Plausibility has its own tests.)"""
    monkeypatch.setattr(cost, "SLACK", 0.0)
    calls = []
    real = cost._measure

    def measure(*args):
        calls.append(args[2:4])  # batch, mode
        return real(*args)
    monkeypatch.setattr(cost, "_measure", measure)
    return calls


SHAPES = [TreeShape.chain(1), TreeShape.full(2, 2)]


def test_measured_once_then_cached_in_the_process_and_the_file(fresh_cache, monkeypatch):
    model = mamba2()
    calls = counting(monkeypatch)
    p = cost_profile(model, 1, shapes=SHAPES, budget_s=2.0)
    assert p.nodes == (2, 7) and p.step_ms > 0 and all(t > 0 for t in p.tree_ms)
    assert cost_profile(model, 1, shapes=SHAPES, budget_s=2.0) is p and len(calls) == 1
    monkeypatch.setattr(cost, "_MEMO", {})  # a new process: the file answers
    assert cost_profile(model, 1, shapes=SHAPES, budget_s=2.0) == p and len(calls) == 1
    # another batch size, mode-independent key parts changed, a drafter: each measured on its own
    cost_profile(model, 2, shapes=SHAPES, budget_s=0.2)
    cost_profile(model, 1, shapes=SHAPES, drafter=NGramDrafter(), budget_s=0.2)
    cost_profile(mamba2(d_model=64), 1, shapes=SHAPES, budget_s=0.2)
    assert len(calls) == 4
    assert len(json.loads(fresh_cache.read_text())["entries"]) == 4


def test_a_profile_is_kept_apart_for_the_half_packs_the_models_step_was_measured_to_take(fresh_cache, monkeypatch):
    """A half model's step whose products take the half packs past the default rows
    (measure_half_rows) prices its passes otherwise: its profile is measured and filed apart from the
    default's (a process that had chosen the other packs read the default's, and its choice of trees
    lost to the default's, paired), and the default's is asked again once the step is back to it."""
    from stree.kernels.cpu import mamba_step
    from stree.models.fused_step import fused_step, half_rows_of

    model = mamba2().to(torch.float16)
    calls = counting(monkeypatch)
    default = cost_profile(model, 1, shapes=SHAPES, budget_s=0.2)
    assert half_rows_of(model) is None
    with torch.no_grad():
        step = fused_step(model, model.allocate_cache(1, 8), None, "auto")
    step.half_rows, step.half_rows_measured = 1 << 30, True
    assert half_rows_of(model) == 1 << 30
    half = cost_profile(model, 1, shapes=SHAPES, budget_s=0.2)
    assert half is not default and len(calls) == 2
    assert len(json.loads(fresh_cache.read_text())["entries"]) == 2
    step.half_rows = mamba_step.HALF_ROWS
    assert half_rows_of(model) is None and cost_profile(model, 1, shapes=SHAPES, budget_s=0.2) is default


def test_a_repeated_ask_is_answered_without_making_the_files_key(fresh_cache, monkeypatch):
    """Every decoding call asks for its profile: the process answers again from what the key is
    made of, and makes the file's key (a JSON text and its digest) only where something in it
    changed (the threads, the dtype, the arguments) or the memo was emptied (a new process)."""
    model = mamba2()
    p = cost_profile(model, 1, shapes=SHAPES, budget_s=0.2)
    keys, real = [], cost._key
    monkeypatch.setattr(cost, "_key", lambda *a, **k: keys.append(a[0]) or real(*a, **k))
    assert cost_profile(model, 1, shapes=SHAPES, budget_s=0.2) is p
    assert cost_profile(mamba2(), 1, shapes=SHAPES, budget_s=0.2) is p  # (another model of the same config)
    assert keys == []
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cost_profile(model, 1, shapes=SHAPES, budget_s=0.2) is not p  # (another device name: measured)
    finally:
        torch.set_num_threads(threads)
    cost_profile(model.to(torch.bfloat16), 1, shapes=SHAPES, budget_s=0.2)
    assert len(keys) == 2
    monkeypatch.setattr(cost, "_MEMO", {})  # a new process: the file's key, then the file answers
    assert cost_profile(mamba2(), 1, shapes=SHAPES, budget_s=0.2) == p and len(keys) == 3


def test_a_repeated_ask_reads_the_models_config_once_per_config_object(fresh_cache, monkeypatch):
    """The key holds the model's config as text: made once per config object (its repr, cold after
    decoding, was a fifth of what a call's lookup took), again for a new one, equal or not."""
    import dataclasses

    model = mamba2()
    p = cost_profile(model, 1, shapes=SHAPES, budget_s=0.2)
    made, real = [], type(model.cfg).__repr__
    monkeypatch.setattr(type(model.cfg), "__repr__", lambda self: made.append(1) or real(self))
    for _ in range(3):
        assert cost_profile(model, 1, shapes=SHAPES, budget_s=0.2) is p
    assert made == []
    model.cfg = dataclasses.replace(model.cfg)  # (an equal config, a new object)
    assert cost_profile(model, 1, shapes=SHAPES, budget_s=0.2) is p and len(made) == 1


def test_a_profile_made_by_other_library_sources_is_measured_again(fresh_cache, monkeypatch, tmp_path):
    """A development install keeps its version string through code changes: the digest of the
    library's sources is part of the key, and follows every file's name and content."""
    digest = cost.source_digest.__wrapped__  # uncached
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "scan.py").write_text("x = 1\n")
    seen = {digest(tmp_path)}
    (tmp_path / "kernels" / "scan.py").write_text("x = 2\n")
    seen.add(digest(tmp_path))
    (tmp_path / "kernels" / "scan.py").rename(tmp_path / "kernels" / "tree.py")
    seen.add(digest(tmp_path))
    (tmp_path / "notes.txt").write_text("not a source")
    seen.add(digest(tmp_path))
    assert len(seen) == 3
    calls = counting(monkeypatch)
    cost_profile(mamba2(), 1, shapes=SHAPES, budget_s=0.2)
    monkeypatch.setattr(cost, "_MEMO", {})
    monkeypatch.setattr(cost, "source_digest", lambda: "0" * 16)
    cost_profile(mamba2(), 1, shapes=SHAPES, budget_s=0.2)
    assert len(calls) == 2 and len(json.loads(fresh_cache.read_text())["entries"]) == 2


def test_the_default_budget_is_read_from_the_environment(fresh_cache, monkeypatch):
    budgets = []
    profile = CostProfile(1.0, (2, 7), (1.5, 2.0))
    monkeypatch.setattr(cost, "_measure", lambda *args: budgets.append(args[6]) or profile)  # (.., budget_s, scan)
    monkeypatch.setenv("STREE_COST_SECONDS", "0.7")
    cost_profile(mamba2(), 1, shapes=SHAPES)
    monkeypatch.delenv("STREE_COST_SECONDS")
    cost_profile(mamba2(), 2, shapes=SHAPES)
    cost_profile(mamba2(), 3, shapes=SHAPES, budget_s=0.4)  # an explicit budget wins
    assert budgets == [0.7, 2.0, 0.4]
    for bad in ("0", "-1", "fast", "nan", "1e9"):
        monkeypatch.setenv("STREE_COST_SECONDS", bad)
        with pytest.raises(ValueError, match=f"STREE_COST_SECONDS must be .*got '{bad}'"):
            cost_profile(mamba2(), 4, shapes=SHAPES)


def test_between_two_batch_sizes_every_time_is_linear_over_the_sizes_both_measured():
    low = CostProfile(2.0, (2, 4, 8), (3.0, 4.0, 8.0), (0.5, 1.0, 1.0), 0.2, (1, 2, 3))
    high = CostProfile(4.0, (2, 4), (5.0, 8.0), (1.5, 2.0), 0.6, (1, 2))
    mid = low.between(high, 0.25)
    assert mid.nodes == (2, 4) and mid.depths == (1, 2)  # 8 nodes: measured at one size only
    assert mid.step_ms == pytest.approx(2.5) and mid.catch_ms == pytest.approx(0.3)
    assert mid.tree_ms == pytest.approx((3.5, 5.0)) and mid.draft_ms == pytest.approx((0.75, 1.25))
    assert low.between(high, 0.0).tree_ms == (3.0, 4.0)


def test_a_bracketed_profile_measures_powers_of_two_only(fresh_cache, monkeypatch):
    """Batch sizes 1..8 in turn (a serving engine's cohort growing) measure 1, 2, 4 and 8; the
    sizes between get the interpolation of their neighbours, one object each."""
    measured = []

    def measure(model, drafter, batch, *rest):
        measured.append(batch)
        return CostProfile(float(batch), (2, 4), (2.0 * batch, 3.0 * batch))
    monkeypatch.setattr(cost, "_measure", measure)
    model = mamba2()
    profiles = [cost.bracketed_profile(model, b, shapes=SHAPES) for b in range(1, 9)]
    assert measured == [1, 2, 4, 8]
    assert profiles[2].step_ms == pytest.approx(3.0) and profiles[4].tree_ms == pytest.approx((10.0, 15.0))
    assert profiles[5] == cost.bracketed_profile(model, 6, shapes=SHAPES) and measured == [1, 2, 4, 8]
    assert cost.bracketed_profile(model, 6, shapes=SHAPES) is profiles[5]  # (what choosers learn is kept per profile)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        cost.bracketed_profile(model, 0)


@pytest.mark.parametrize("damage", ["garbage", "wrong-format", "foreign-key", "bad-value"])
def test_a_corrupt_or_foreign_cache_is_measured_again(fresh_cache, monkeypatch, damage):
    model = mamba2()
    p = cost_profile(model, 1, shapes=SHAPES, budget_s=2.0)
    data = json.loads(fresh_cache.read_text())
    key = next(iter(data["entries"]))
    if damage == "garbage":
        fresh_cache.write_text("{not json")
    else:
        if damage == "wrong-format":
            data["format"] = 999
        elif damage == "foreign-key":  # an entry copied from another machine / config under this key
            data["entries"][key]["key"] = "0" * 32
        else:
            data["entries"][key]["value"]["step_ms"] = -1.0
        fresh_cache.write_text(json.dumps(data))
    monkeypatch.setattr(cost, "_MEMO", {})
    calls = counting(monkeypatch)
    again = cost_profile(model, 1, shapes=SHAPES, budget_s=2.0)
    assert len(calls) == 1 and again.nodes == p.nodes
    assert json.loads(fresh_cache.read_text())["entries"][key]["value"]["step_ms"] > 0  # rewritten whole


def test_an_unwritable_cache_is_not_fatal(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("STREE_CACHE_DIR", str(blocker / "sub"))  # a directory under a file
    monkeypatch.setattr(cost, "_MEMO", {})
    assert cost_profile(mamba2(), 1, shapes=SHAPES, budget_s=0.1).step_ms > 0


def test_a_forgotten_profile_leaves_the_file_and_the_next_process_measures_it_again(fresh_cache, monkeypatch):
    """``forget``: the profile's entry leaves the cache file (the other entries stay), this process
    keeps answering with it, and a new process measures it again. A profile this process never read
    or wrote (made by hand, or interpolated), or a file that cannot be read, changes nothing."""
    answers = [CostProfile(4.0, (2, 4), (6.0, 8.0)), CostProfile(1.0, (2, 4), (1.5, 2.0)),
               CostProfile(0.9, (2, 4), (1.4, 1.9))]
    monkeypatch.setattr(cost, "_measure", lambda *args: answers.pop(0))
    model = mamba2()
    shapes = [TreeShape.full(1, 1), TreeShape.full(3, 1)]
    slow, other = cost_profile(model, 1, shapes=shapes), cost_profile(model, 2, shapes=shapes)
    cost.forget(CostProfile(4.0, (2, 4), (6.0, 8.0)))  # (equal, but not the one this process read)
    assert len(json.loads(fresh_cache.read_text())["entries"]) == 2
    cost.forget(slow)
    entries = json.loads(fresh_cache.read_text())["entries"]
    assert [e["value"]["step_ms"] for e in entries.values()] == [1.0]
    assert cost_profile(model, 1, shapes=shapes) is slow and cost_profile(model, 2, shapes=shapes) is other
    monkeypatch.setattr(cost, "_MEMO", {})  # a new process
    assert cost_profile(model, 1, shapes=shapes).step_ms == 0.9 and not answers
    fresh_cache.write_text("{not json")
    cost.forget(cost_profile(model, 1, shapes=shapes))
    assert fresh_cache.read_text() == "{not json"


def test_the_file_keeps_every_entry_of_these_sources_and_the_newest_of_other_sources(fresh_cache, monkeypatch):
    """An entry made by other library sources is never read again by these (its key holds their
    digest): written with a new one, the file keeps every entry of these sources and the newest
    KEEP_OTHERS of the others (another installation sharing the directory keeps its own), not all
    of them for good."""
    monkeypatch.setattr(cost, "_measure", lambda *args: CostProfile(1.0, (2, 4), (1.5, 2.0)))
    monkeypatch.setattr(cost, "KEEP_OTHERS", 5)
    code = cost.source_digest()
    made = {f"other{i}": dict(key=f"other{i}", value={}, made=dict(code="elsewhere", date=f"2026-01-{i + 1:02d}"))
            for i in range(8)}
    made["ours"] = dict(key="ours", value={}, made=dict(code=code, date="2025-01-01"))  # (older than them all)
    made["odd"], made["odder"] = "not an entry", dict(key="odder", made="not a record")
    fresh_cache.write_text(json.dumps(dict(format=cost.FORMAT, entries=made)))
    cost_profile(mamba2(), 1, shapes=SHAPES)
    kept = json.loads(fresh_cache.read_text())["entries"]
    assert len(kept) == 2 + 5 and "ours" in kept and {f"other{i}" for i in range(3, 8)} <= set(kept)  # (odd ones first)
    # (a profile this process never read or wrote: the file is not even read)
    monkeypatch.setattr(cost, "cache_file", lambda: pytest.fail("forget read the file"))
    cost.forget(CostProfile(1.0, (2, 4), (1.5, 2.0)))


def test_measuring_leaves_the_drafter_reset_and_its_random_stream_as_it_was(fresh_cache):
    """Measuring drafts and observes like the loop: a STAND store, which outlives calls, is
    measured through a fresh copy (learning from the measurement's random text made the first
    seeded call after it decode differently from the next), its random stream left untouched."""
    from stree.drafters.registry import make_drafter

    model = mamba2()
    drafter = make_drafter("stand")
    drafter.reseed(5)
    expected = drafter.generator.get_state()
    cost_profile(model, 2, drafter=drafter, shapes=SHAPES, budget_s=0.2)
    assert torch.equal(drafter.generator.get_state(), expected)
    assert int(drafter.store.count.sum()) == 0 and drafter._pos == 0 and len(drafter._noise) == 0
    consensus = make_drafter("consensus")  # its store keeps every path it is shown
    cost_profile(model, 2, drafter=consensus, shapes=SHAPES, budget_s=0.2)
    assert consensus.store.size == 0 and consensus.store.tokens == []
    ngram = NGramDrafter()
    cost_profile(model, 1, drafter=ngram, shapes=SHAPES, budget_s=0.2)
    assert ngram._rows == {}


def test_the_budget_cuts_the_sizes_measured(fresh_cache, monkeypatch):
    slow = {"n": 0}
    real_sleepless = cost._timed_rounds

    def rounds(calls, budget_s, sync, **kw):
        def slowed(fn):
            def run():
                import time
                time.sleep(0.05)
                slow["n"] += 1
                fn()
            return run
        return real_sleepless([slowed(fn) for fn in calls], budget_s, sync, **kw)
    monkeypatch.setattr(cost, "_timed_rounds", rounds)
    shapes = [TreeShape.chain(k) for k in (1, 2, 3, 4, 5)]
    p = cost_profile(mamba2(), 1, shapes=shapes, budget_s=0.1)
    assert 1 <= len(p.nodes) < 5 and p.nodes == tuple(s.n for s in shapes[: len(p.nodes)])
    assert p.iteration_ms(6) > 0  # sizes past the measured ones are extrapolated


def test_a_slow_first_use_does_not_cut_the_sizes_measured():
    """The first call of the step and of the smallest tree pays once per process (numba compiling
    or loading a drafter's code: seconds): the budget starts after it, so every size the budget
    affords is still measured (a STAND profile had been cut to its 2-node tree for good)."""
    import time

    first = {"done": False}

    def slow_first():
        if not first["done"]:
            first["done"] = True
            time.sleep(0.3)

    calls = [slow_first] + [lambda: None] * 5
    assert len(cost._timed_rounds(calls, 0.2, lambda: None)[0]) == 6


def test_a_chain_choice_is_priced_by_the_scan_that_verifies_its_chains(fresh_cache, monkeypatch):
    """``method="chain"`` verifies with the multi-step update (``scan="chain"``), whose CPU path
    was the PyTorch reference: priced by the tree scan's passes, its chains had cost three times
    what the choice expected. The profile times the scan it is asked for, and keeps it apart in
    the file; a chain decoding call asks for its scan."""
    import stree.decoding.steps as steps
    from stree.decoding.loop import generate

    scans = []
    real = steps.speculative_step

    def spy(model, cache, draft, params, generator, scan="tree", **kw):
        scans.append(scan)
        return real(model, cache, draft, params, generator, scan, **kw)
    monkeypatch.setattr(steps, "speculative_step", spy)
    model, chains = mamba2(), [TreeShape.chain(1), TreeShape.chain(3)]
    monkeypatch.setattr(cost, "SLACK", 0.0)  # (an implausible profile, under load, would not be written)
    tree = cost_profile(model, 1, shapes=chains, budget_s=0.2)
    assert set(scans) == {"tree"}
    scans.clear()
    chain = cost_profile(model, 1, shapes=chains, budget_s=0.2, scan="chain")
    assert set(scans) == {"chain"} and chain is not tree
    assert len(json.loads(fresh_cache.read_text())["entries"]) == 2
    asked = []
    monkeypatch.setattr(cost, "_measure", lambda *args: asked.append(args[7]) or chain)
    generate(model, torch.tensor([[1, 2, 3, 4]]), drafter=NGramDrafter(), method="chain", max_new_tokens=4)
    assert asked and set(asked) == {"chain"}
    with pytest.raises(ValueError, match="scan"):
        cost_profile(model, 1, shapes=chains, scan="unrolled")


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        cost_profile(mamba2(), 1, mode="fast")
    with pytest.raises(ValueError, match="batch_size"):
        cost_profile(mamba2(), 0)


def test_a_drafter_models_catch_up_is_timed_per_token(fresh_cache):
    """What a probe after plain steps pays before drafting: the drafter model reading the tokens it
    missed. Measured for a drafter with a model (about its prefill's time per token), 0 without."""
    from stree.drafters import SSMDrafter

    model, small = mamba2(), mamba2(n_layer=1, seed=3)
    ssm = cost_profile(model, 1, drafter=SSMDrafter(small), shapes=SHAPES, budget_s=0.3)
    assert ssm.catch_ms > 0 and ssm.depths == tuple(s.max_depth for s in SHAPES)  # its drafting priced by depth
    ngram = cost_profile(model, 1, drafter=NGramDrafter(), shapes=SHAPES, budget_s=0.2)
    assert ngram.catch_ms == 0.0 and ngram.depths == ()


def test_compiled_sizes_are_all_timed_whatever_their_compiling_takes():
    """Each size's first call compiles (seconds on the CPU) or captures a graph: cut by the budget,
    a compiled choice knew one tree size alone. With keep_all every call is warmed up and timed."""
    import time

    from stree.decoding.cost import _timed_rounds

    def slow_first():
        first = [True]

        def call():
            if first[0]:
                first[0] = False
                time.sleep(0.05)
        return call

    # eager: the budget starts after the first two warm-ups, and the third one spends it
    assert len(_timed_rounds([slow_first() for _ in range(4)], 0.01, lambda: None)[0]) == 3
    assert len(_timed_rounds([slow_first() for _ in range(4)], 0.01, lambda: None, keep_all=True)[0]) == 4


def profile_on_a_clock(monkeypatch, plain, tree, shapes):
    """A tiny Mamba2's profile at batch 1 over ``shapes``, timed on a made-up clock that a plain step
    moves by ``plain()`` ms and a tree of n nodes by ``tree(n)`` ms (the real calls still run)."""
    import stree.decoding.steps as steps

    clock = {"t": 0.0}
    real_step, real_spec = steps.autoregressive_step, steps.speculative_step

    def step(*args, **kw):
        clock["t"] += plain() * 1e-3
        return real_step(*args, **kw)

    def spec(model, cache, draft, *args, **kw):
        clock["t"] += tree(draft.n) * 1e-3
        return real_spec(model, cache, draft, *args, **kw)

    monkeypatch.setattr(steps, "autoregressive_step", step)
    monkeypatch.setattr(steps, "speculative_step", spec)
    monkeypatch.setattr(cost.time, "perf_counter", lambda: clock["t"])
    return cost_profile(mamba2(), 1, shapes=shapes, budget_s=0.05)


def test_a_plain_step_is_timed_past_a_trees_wake_and_the_wake_is_the_trees(fresh_cache, monkeypatch):
    """On a clock that makes the three plain steps after a tree take 3, 2 and 1.5 ms where later
    ones take 1 ms and a tree pass 2 ms: the profile's plain step is the 1 ms one (timed as the
    step after one plain step, it had been the 2 ms one), and its trees cost 2 ms and the 3.5 ms
    their wake took beyond plain steps. The loop charges a tree the same steps (AutoTree.AFTERMATH)."""
    from stree.decoding.autotree import AutoTree

    wake, since = (3.0, 2.0, 1.5), [99]

    def plain():
        since[0] += 1
        return wake[since[0] - 1] if since[0] - 1 < len(wake) else 1.0

    def tree(n):
        since[0] = 0
        return 2.0

    p = profile_on_a_clock(monkeypatch, plain, tree, [TreeShape.chain(1), TreeShape.chain(2)])
    assert p.step_ms == pytest.approx(1.0)
    assert p.tree_ms == pytest.approx((5.5, 5.5))
    assert AutoTree.AFTERMATH == cost.WAKE == len(wake)


def test_an_implausible_profile_is_measured_again_and_never_trusted_from_the_file(fresh_cache, monkeypatch):
    """A tree's iteration below 0.8 of a plain step's (measured while other work took the cores):
    timed once more; kept for the process if it stays so, but not written to the file, and such an
    entry in the file is measured again."""
    odd, fine = CostProfile(4.0, (2, 4), (4.5, 3.0)), CostProfile(4.0, (2, 4), (4.5, 6.0))
    assert not odd.plausible and not CostProfile(4.0, (2,), (3.1,)).plausible
    assert fine.plausible and CostProfile(4.0, (2, 4, 8), (3.3, 9.0, 3.5)).plausible  # (within the slack)
    answers, measured = [odd, fine, odd, odd, fine], []

    def measure(model, drafter, batch, *rest):
        measured.append(batch)
        return answers[len(measured) - 1]
    monkeypatch.setattr(cost, "_measure", measure)
    model = mamba2()
    assert cost_profile(model, 1, shapes=SHAPES) is fine and measured == [1, 1]
    assert cost_profile(model, 2, shapes=SHAPES) is odd and measured == [1, 1, 2, 2]
    assert cost_profile(model, 2, shapes=SHAPES) is odd and len(measured) == 4  # (the process keeps it)
    assert len(json.loads(fresh_cache.read_text())["entries"]) == 1  # (batch 1's alone)
    monkeypatch.setattr(cost, "_MEMO", {})  # a new process
    assert cost_profile(model, 1, shapes=SHAPES) == fine and len(measured) == 4
    assert cost_profile(model, 2, shapes=SHAPES) is fine and measured == [1, 1, 2, 2, 2]
    # an implausible entry a file already holds (an earlier version wrote every profile) is measured again
    data = json.loads(fresh_cache.read_text())
    for entry in data["entries"].values():
        entry["value"] = odd.to_dict()
    fresh_cache.write_text(json.dumps(data))
    monkeypatch.setattr(cost, "_MEMO", {})
    answers.append(fine)
    assert cost_profile(model, 1, shapes=SHAPES) is fine and measured == [1, 1, 2, 2, 2, 1]


def test_agrees_holds_every_common_size_within_a_factor_and_a_plain_step_not_far_dearer():
    cached = CostProfile(4.0, (2, 4, 8), (6.0, 8.0, 12.0), (1.0, 1.0, 2.0))
    assert cost.agrees(cached, CostProfile(8.0, (2, 8), (12.0, 24.0), (2.0, 4.0)))  # the same in steps, busier now
    assert cost.agrees(cached, CostProfile(2.7, (2, 8), (4.05, 8.1), (0.675, 1.35)))  # (4 ms against 2.7: 1.48x)
    # the same in steps, but the cached one measured while other work took the cores: its plain step
    # dearer than STALE times the spot check's
    assert not cost.agrees(cached, CostProfile(2.0, (2, 8), (3.0, 6.0), (0.5, 1.0)))
    assert not cost.agrees(cached, CostProfile(2.6, (2, 8), (3.9, 7.8), (0.65, 1.3)))  # (1.54x)
    assert cost.agrees(cached, CostProfile(4.0, (2,), (6.0 * 1.2 + 1.4,), (0.0,)))  # (7 -> 8.6 ms: 1.23x)
    assert not cost.agrees(cached, CostProfile(4.0, (2,), (6.0 * 1.3 + 1.8,), (0.0,)))  # (7 -> 9.6 ms: 1.37x)
    assert not cost.agrees(cached, CostProfile(4.0, (4, 8), (8.0, 9.0), (1.0, 1.0)))  # 8 nodes: 14 ms -> 10 ms
    assert cost.agrees(cached, CostProfile(4.0, (16,), (40.0,)))  # no common size: nothing to say


def test_a_checked_profile_from_the_file_is_spot_checked_and_measured_again_where_it_is_off(fresh_cache,
                                                                                             monkeypatch):
    """``check`` (an adaptive choice's): a profile the file holds is timed again at its first and
    middle sizes, in an eighth of the budget; where they disagree, measured again and rewritten;
    where they agree, the file's is kept. Without ``check`` (a seeded choice), the file's as it is."""
    cached = CostProfile(4.0, (2, 4, 8), (6.0, 8.0, 12.0))
    spots = {"agree": CostProfile(3.0, (2, 4), (4.6, 6.1)), "off": CostProfile(4.0, (2, 4), (4.5, 5.0)),
             "stale": CostProfile(2.0, (2, 4), (3.1, 4.1))}  # (the same in steps, the plain step half the file's)
    answer, calls = {}, []
    fresh = {"off": CostProfile(4.0, (2, 4, 8), (4.5, 5.0, 7.0)), "stale": CostProfile(2.0, (2, 4, 8), (3.0, 4.0, 6.0))}

    def measure(model, drafter, batch, mode, sampled, shapes, budget_s, scan):
        calls.append(([s.n for s in shapes], budget_s))
        return answer["spot"] if len(shapes) < 3 else answer["fresh"]
    model = mamba2()
    shapes = [TreeShape.full(1, 1), TreeShape.full(3, 1), TreeShape.full(7, 1)]  # 2, 4 and 8 nodes
    for mode in ("eager", "compiled"):
        cost._write(cost._key("profile", model, batch=1, mode=mode, sizes=[2, 4, 8], drafter=None, sampled=False)[0],
                    dict(value=cached.to_dict()))
    monkeypatch.setattr(cost, "_measure", measure)
    assert cost_profile(model, 1, shapes=shapes) == cached and calls == []  # unchecked: the file's
    # compiled (or graphed): a spot check would compile its calls again
    assert cost_profile(model, 1, shapes=shapes, mode="compiled", check=True) == cached and calls == []
    remeasured = [([2, 4], 0.0625), ([2, 4, 8], 0.5), ([2, 4], 0.0625)]  # (the measured one spot-checked too)
    for case in ("agree", "off", "stale"):
        monkeypatch.setattr(cost, "_MEMO", {})  # a new process
        answer.update(spot=spots[case], fresh=fresh.get(case))
        calls[:] = []
        want, timed = (cached, [([2, 4], 0.0625)]) if case == "agree" else (fresh[case], remeasured)
        assert cost_profile(model, 1, shapes=shapes, budget_s=0.5, check=True) == want and calls == timed, case
        monkeypatch.setattr(cost, "_MEMO", {})
        assert cost_profile(model, 1, shapes=shapes) == want and calls == timed  # the file now holds it


def test_a_checked_profile_measured_here_is_spot_checked_and_measured_once_more_where_it_is_off(fresh_cache,
                                                                                                  monkeypatch):
    """``check``: a profile just measured (none in the file) is timed again at its first and middle
    sizes at once; where they disagree (other work took the cores during some of its rounds), it
    is measured once more, and that one is kept whatever a spot check would say. Unchecked (a
    seeded choice) or compiled, the first measurement as it is."""
    bursty = CostProfile(4.0, (2, 4, 8), (6.0, 14.0, 12.0))  # 4 nodes measured during a burst: 3.5 steps
    fine = CostProfile(4.0, (2, 4, 8), (6.0, 7.0, 12.0))
    spot = CostProfile(4.0, (2, 4), (6.1, 7.1))
    calls = []

    def measure(model, drafter, batch, mode, sampled, shapes, budget_s, scan):
        calls.append([s.n for s in shapes])
        if len(shapes) < 3:
            return spot
        return bursty if sum(len(c) == 3 for c in calls) == 1 else fine
    monkeypatch.setattr(cost, "_measure", measure)
    shapes = [TreeShape.full(1, 1), TreeShape.full(3, 1), TreeShape.full(7, 1)]  # 2, 4 and 8 nodes
    model = mamba2()
    assert cost_profile(model, 1, shapes=shapes, check=True) == fine
    assert calls == [[2, 4, 8], [2, 4], [2, 4, 8]]
    for kw in (dict(), dict(mode="compiled", check=True)):
        monkeypatch.setattr(cost, "_MEMO", {})
        calls[:] = []
        assert cost_profile(model, 2, shapes=shapes, **kw) == bursty and calls == [[2, 4, 8]], kw


def new_process(monkeypatch):
    """What a new process knows of the costs: the file alone (the profiles and auto_tree's look-ups gone)."""
    from stree.decoding import autotree

    monkeypatch.setattr(cost, "_MEMO", {})
    monkeypatch.setattr(autotree, "_ASKED", type(autotree._ASKED)())


def test_a_profile_the_file_prices_far_off_is_measured_again_by_an_adaptive_choice(fresh_cache, monkeypatch):
    """For real: a file whose trees cost eight times what this machine's do (measured beside other
    work), read by a new process's adaptive choice, is measured again; a seeded one keeps it. (Eight,
    not four: under a loaded CI run the second measurement came out 2.8x the first, past the half.)"""
    from stree.decoding.autotree import auto_tree

    model = mamba2()
    measured = auto_tree(model, NGramDrafter(), 1, mode="eager", adaptive=True).profile
    data = json.loads(fresh_cache.read_text())
    (entry,) = data["entries"].values()
    entry["value"]["tree_ms"] = [8 * (t + d) for t, d in zip(entry["value"]["tree_ms"], entry["value"]["draft_ms"])]
    fresh_cache.write_text(json.dumps(data))
    dear = CostProfile.from_dict(entry["value"])
    new_process(monkeypatch)
    assert auto_tree(model, NGramDrafter(), 1, mode="eager").profile == dear  # seeded: the file's trees
    new_process(monkeypatch)
    again = auto_tree(model, NGramDrafter(), 1, mode="eager", adaptive=True).profile
    common = [n for n in again.nodes if n in measured.nodes]  # (a loaded machine's budget may cut sizes)
    assert again != dear and common
    assert sum(again.iteration_ms(n) for n in common) < 0.5 * sum(dear.iteration_ms(n) for n in common)
    (entry,) = json.loads(fresh_cache.read_text())["entries"].values()
    # Rewritten, unless both measurements met a burst of other work that made a tree cheaper than
    # SLACK of a step (CI's run once: a step 1.76 ms, a tree 1.38): such a profile is never written.
    assert CostProfile.from_dict(entry["value"]) == (again if again.plausible else dear)


def test_tree_costs_are_made_non_decreasing_by_pooling_adjacent_violators():
    """A larger tree timed below a smaller one was timed by noise: the two are pooled into their
    mean (the closest non-decreasing sequence in squared error), which keeps the total."""
    out = cost.nondecreasing([1.5, 1.3, 2.1, 2.0, 1.9, 3.0])
    assert out == pytest.approx([1.4, 1.4, 2.0, 2.0, 2.0, 3.0])
    assert sum(out) == pytest.approx(1.5 + 1.3 + 2.1 + 2.0 + 1.9 + 3.0)
    assert cost.nondecreasing([1.0, 1.0, 2.0, 5.0]) == [1.0, 1.0, 2.0, 5.0]  # (already so: kept)
    assert cost.nondecreasing([]) == []


def test_wakes_are_fitted_as_one_line_over_the_sizes():
    """Each size's wake, timed as plain steps' sums less their medians, scatters: a profile's wakes
    are the least-squares line a + b nodes through them all, neither coefficient below 0."""
    nodes = [2, 4, 8, 16]
    assert cost.fitted_wakes(nodes, [0.1, 0.3, 0.5, 0.9]) == pytest.approx([0.1, 0.3, 0.5, 0.9], abs=0.11)
    line = cost.fitted_wakes(nodes, [0.0, 0.2, 0.08, 0.13])  # (a profile's, batch 2: noise about a line)
    assert all(b >= a for a, b in zip(line, line[1:])) and line[0] > 0.0
    assert cost.fitted_wakes(nodes, [0.3, 0.2, 0.1, 0.0]) == pytest.approx([0.15] * 4)  # (falling: their mean)
    assert cost.fitted_wakes(nodes, [0.0, 0.0, 0.05, 0.3]) == pytest.approx(  # (a negative intercept: a line through 0)
        [x * (8 * 0.05 + 16 * 0.3) / (4 + 16 + 64 + 256) for x in nodes])
    assert cost.fitted_wakes([2, 4], [0.4, 0.0]) == [0.4, 0.0]  # (two sizes: nothing to fit them by)


def test_the_cpu_measures_every_small_size_where_a_gpu_measures_powers_of_two():
    """A CPU pass's cost stays level up to a tile of its products' rows and then climbs: every size
    up to 8 (and every other to 16) is timed, so the knee is not smoothed over by interpolation."""
    cpu = cost.default_sizes(torch.device("cpu"))
    assert set(range(2, 9)) <= set(cpu) and {10, 12, 14, 16, 64} <= set(cpu) and max(cpu) == 64
    assert list(cpu) == sorted(set(cpu))
    assert cost.default_sizes(torch.device("cuda")) == (2, 4, 8, 16, 32, 64, 128, 256)


def test_a_measured_profile_never_prices_a_larger_tree_below_a_smaller_one(fresh_cache, monkeypatch):
    """On a clock where the 3-node tree's iteration takes less than the 2-node one's, the profile
    pools them: no size is cheaper than a smaller one (the choice would seize the dip)."""
    taken = {2: 3.0, 3: 2.0}
    p = profile_on_a_clock(monkeypatch, lambda: 1.0, taken.__getitem__, [TreeShape.chain(1), TreeShape.chain(2)])
    assert p.step_ms == pytest.approx(1.0)
    assert p.tree_ms == pytest.approx((2.5, 2.5))
