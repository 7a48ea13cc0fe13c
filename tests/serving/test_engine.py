"""The continuous-batching engine on the shipped pair: every request's greedy output is what
decoding it alone gives, whatever runs beside it (requests arriving at random times, mixed
drafters, lengths, stop strings, cancellations); sampled requests keep the target's law (exact
enumeration and chi-square); long prompts are read in chunks between other rows' steps; slots
come back; bad requests are refused before anything is queued."""

import collections
import functools
import itertools
import json
import math
import random
import threading
import time

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import stree
from stree.decoding.loop import generate
from stree.models.base import MAX_TREE_NODES, TreeLM
from stree.serving import Engine, EngineClosed, Overloaded
from stree.tools.demo import DRAFTER, TARGET

PROMPTS = [json.loads(line)["prompt"] for line in open(f"{TARGET}/prompts.jsonl")][:8]


@pytest.fixture(scope="module")
def lm():
    return stree.LM.from_pretrained(TARGET, dtype="float32", drafter_model=DRAFTER)


def _alone(lm, prompt, max_tokens, drafter, stop=None):
    out = lm.generate(prompt, max_new_tokens=max_tokens, drafter=drafter, stop=stop, temperature=0)
    return out.texts[0], out.token_ids[0], out.finish_reasons[0]


def test_requests_arriving_at_random_times_decode_as_they_do_alone(lm):
    """32 requests from 4 threads at random times into 6 slots: mixed drafters (autoregressive
    included), budgets and stop strings, and 4 cancelled on the way. Every finished one is its
    solo run; a cancelled one a prefix of it; every slot comes back."""
    rng = random.Random(0)
    drafters = ["ngram", "stand", None, "ssm"]
    jobs = []
    for i in range(32):
        stop = rng.choice([None, None, "\n\n", "return"])
        jobs.append(dict(prompt=PROMPTS[i % len(PROMPTS)][: rng.randint(20, 200)], max_tokens=rng.randint(1, 40),
                         drafter=drafters[i % 4], stop=stop, wait=rng.uniform(0, 0.05), cancel=i % 8 == 3))
    requests = [None] * len(jobs)
    with Engine(lm, max_slots=6, max_length=512, seed=0) as engine:
        def client(part):
            for i in part:
                time.sleep(jobs[i]["wait"])
                job = jobs[i]
                requests[i] = engine.submit(job["prompt"], max_tokens=job["max_tokens"], drafter=job["drafter"],
                                            stop=job["stop"])
                if job["cancel"]:
                    requests[i].cancel()

        threads = [threading.Thread(target=client, args=(range(k, 32, 4),)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [r.result(timeout=300) for r in requests]
        streamed = [list(r) for r in requests]  # (the events are kept for a late reader)
        assert engine.free_slots == 6 and engine.queue_length == 0
    cancelled = 0
    for job, (choice,), events in zip(jobs, results, streamed):
        text, ids, reason = _alone(lm, job["prompt"], job["max_tokens"], job["drafter"], job["stop"])
        assert "".join(e.text for e in events) == choice.text
        assert [t for e in events for t in e.token_ids] == choice.token_ids
        assert events[-1].finish_reason == choice.finish_reason
        if choice.finish_reason == "cancelled":
            cancelled += 1
            assert ids[: len(choice.token_ids)] == choice.token_ids
        else:
            assert (choice.text, choice.token_ids, choice.finish_reason) == (text, ids, reason), job
    assert cancelled >= 1  # (a cancel may land after a short request ended)


def test_n_choices_and_a_full_engine(lm):
    """``n`` greedy choices are n copies of the solo run, in n slots; a request that cannot wait
    is refused as Overloaded, and a closed engine takes nothing."""
    text, ids, _ = _alone(lm, PROMPTS[0], 12, "ngram")
    with Engine(lm, max_slots=3, max_length=256, max_queue=0, seed=0) as engine:
        request = engine.submit(PROMPTS[0], max_tokens=12, n=3)
        with pytest.raises(Overloaded, match="wait for a slot"):
            while True:  # (the engine may take the first request into its slots before this one)
                engine.submit(PROMPTS[1], max_tokens=4, n=3)
        assert [(c.index, c.text, c.token_ids) for c in request.result(timeout=60)] == \
            [(i, text, ids) for i in range(3)]
    with pytest.raises(EngineClosed):
        engine.submit(PROMPTS[0], max_tokens=4)


def test_logprobs_are_each_requests_own_whatever_the_cohort_keeps(lm):
    """Requests asking for different numbers of top entries (and one for none) share a cohort: each
    choice's log-probabilities are its solo run's (``LM.generate(logprobs=k)``), the events carry
    them token by token, and a stop string cuts them with the tokens."""
    asks = [None, 0, 3, 5]
    with Engine(lm, max_slots=4, max_length=512, seed=0) as engine:
        requests = [engine.submit(PROMPTS[i], max_tokens=16, logprobs=k, stop="\n\n" if i == 3 else None)
                    for i, k in enumerate(asks)]
        results = [r.result(timeout=120)[0] for r in requests]
        streamed = [list(r) for r in requests]
    for i, (k, choice, events) in enumerate(zip(asks, results, streamed)):
        solo = lm.generate(PROMPTS[i], max_new_tokens=16, drafter="ngram", temperature=0, logprobs=k,
                           stop="\n\n" if i == 3 else None)
        assert choice.token_ids == solo.token_ids[0]
        if k is None:
            assert choice.logprobs is None and all(e.logprobs is None for e in events)
            continue
        assert [lp for e in events for lp in e.logprobs] == choice.logprobs
        assert [lp.token for lp in choice.logprobs] == choice.token_ids
        for got, want in zip(choice.logprobs, solo.logprobs[0], strict=True):
            assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [i for i, _ in got.top] == [i for i, _ in want.top] and len(got.top) == k
            assert [p for _, p in got.top] == pytest.approx([p for _, p in want.top], abs=1e-4)


def test_prompt_logprobs_score_every_prompt_token_across_chunks(lm, monkeypatch):
    """``prompt_logprobs``: the prompt read in chunks of 16 tokens, each token after the first
    scored under the model's own law after the tokens before it (against the model stepped token
    by token); with ``max_tokens=0`` nothing is generated and the slots come back; with tokens,
    they are the solo run's."""
    import stree.serving.engine as engine_module

    monkeypatch.setattr(engine_module, "MAX_TREE_NODES", 16)
    ids = lm.encode(PROMPTS[2])[0][:40]
    model = lm.model
    cache = model.allocate_cache(1, 64)
    laws = [torch.softmax(model.step(torch.tensor([t], device=model.device), cache)[0].float(), -1) for t in ids[:-1]]
    with Engine(lm, max_slots=2, max_length=128, seed=0) as engine:
        scored = engine.submit(ids, max_tokens=0, prompt_logprobs=2, n=2)
        both = engine.submit(ids, max_tokens=6, prompt_logprobs=0, logprobs=1)
        (a, b), (c,) = scored.result(timeout=60), both.result(timeout=60)
        assert engine.free_slots == 2
    assert (a.token_ids, a.finish_reason, b.token_ids, b.finish_reason) == ([], "length", [], "length")
    assert c.token_ids == stree.generate(model, [ids], max_new_tokens=6, eos_token_id=lm.eos_token_id).new_tokens[0]
    assert scored.prompt_scores[0] is None and both.prompt_scores[0] is None
    assert len(scored.prompt_scores) == len(both.prompt_scores) == len(ids)
    for token, law, lp, lp0 in zip(ids[1:], laws, scored.prompt_scores[1:], both.prompt_scores[1:], strict=True):
        assert lp.token == lp0.token == token
        assert lp.logprob == pytest.approx(math.log(law[token]), abs=1e-4) and lp0.logprob == lp.logprob
        top = torch.topk(law, 2)
        assert [i for i, _ in lp.top] == top.indices.tolist() and lp0.top == ()
        assert [p for _, p in lp.top] == pytest.approx(top.values.log().tolist(), abs=1e-4)


def test_a_long_prompt_is_read_between_the_other_rows_steps(lm, monkeypatch):
    """A prompt of three chunks joins while another request decodes: its prefill calls carry at
    most MAX_TREE_NODES tokens each, and the other request's steps run between them."""
    calls = []
    for name in ("prefill", "step", "greedy_step", "forward_tree"):  # (a greedy step that ran is a step)
        real = getattr(TreeLM, name)

        def spy(self, tokens, cache, *a, _real=real, _name=name, **k):
            out = _real(self, tokens, cache, *a, **k)
            if out is not None:
                calls.append((_name.removeprefix("greedy_"), tokens.shape[-1] if _name == "prefill" else 0))
            return out

        monkeypatch.setattr(TreeLM, name, spy)
    ids = lm.encode(PROMPTS[1] * (1 + 3 * MAX_TREE_NODES // len(lm.encode(PROMPTS[1])[0])))[0]
    ids = ids[: 2 * MAX_TREE_NODES + 10]
    with Engine(lm, max_slots=2, max_length=3 * MAX_TREE_NODES, seed=0) as engine:
        first = engine.submit(PROMPTS[0], max_tokens=60, drafter=None)
        next(iter(first))  # decoding
        second = engine.submit(ids, max_tokens=4, drafter=None)
        second.result(timeout=60)
        first.result(timeout=60)
    chunks = [i for i, (name, n) in enumerate(calls) if name == "prefill"]
    assert [calls[i][1] for i in chunks] == [len(lm.encode(PROMPTS[0])[0]), MAX_TREE_NODES, MAX_TREE_NODES, 10]
    chunks = chunks[1:]
    between = [name for name, _ in calls[chunks[0]: chunks[-1]]]
    assert between.count("step") >= 2


def test_prompts_admitted_together_are_read_in_one_call_each_chunk(lm, monkeypatch):
    """While the first request's prefill holds the engine, three more arrive: they are read
    together, one call for each chunk of the rows still reading (prompts of 1, 2 and 3 chunks:
    calls of 3, 2 and 1 rows), and each decodes as it does alone."""
    calls, release = [], threading.Event()
    real = TreeLM.prefill

    def spy(self, tokens, cache, *a, **k):
        if not calls:
            release.wait(30)  # the first request's prefill waits for the other three to be queued
        calls.append(tuple(tokens.shape))
        return real(self, tokens, cache, *a, **k)

    monkeypatch.setattr(TreeLM, "prefill", spy)
    text = PROMPTS[1] * (1 + 3 * MAX_TREE_NODES // len(lm.encode(PROMPTS[1])[0]))
    ids = lm.encode(text)[0]
    prompts = [ids[:9], ids[: MAX_TREE_NODES + 5], ids[: 2 * MAX_TREE_NODES + 3]]
    with Engine(lm, max_slots=4, max_length=3 * MAX_TREE_NODES, seed=0) as engine:
        first = engine.submit(PROMPTS[0], max_tokens=3, drafter=None)
        while not calls and not release.is_set():
            time.sleep(0.001)
            if engine._prefilling:  # (admitted: its prefill is about to wait)
                break
        together = [engine.submit(p, max_tokens=5, drafter=None) for p in prompts]
        release.set()
        outs = [r.result(timeout=60)[0] for r in [first] + together]
    assert calls[1:] == [(3, MAX_TREE_NODES), (2, MAX_TREE_NODES), (1, 3)], calls
    for prompt, out in zip(prompts, outs[1:]):
        alone = generate(lm.model, [prompt], method="autoregressive", max_new_tokens=5, eos_token_id=lm.eos_token_id)
        assert out.token_ids == alone.sequences[0][len(prompt):]


def two_token_top2_law(model, prompt, temperature):
    """The exact law of the first two tokens drawn at ``temperature`` from the target's top 2."""
    with torch.no_grad():
        cache = model.allocate_cache(1, 64 + len(prompt))
        on = functools.partial(torch.tensor, device=model.device)  # (the model's device: a GPU where there is one)
        first = (model.prefill(on([prompt]), cache)[0].double() / temperature).softmax(-1).topk(2)
        law = {}
        for a, pa in zip(first.indices.tolist(), (first.values / first.values.sum()).tolist()):
            logits = model.step(on([a]), cache.select(on([0])))[0].double()
            second = (logits / temperature).softmax(-1).topk(2)
            for b, pb in zip(second.indices.tolist(), (second.values / second.values.sum()).tolist()):
                law[(a, b)] = pa * pb
    return law


def test_sampled_requests_keep_the_targets_law(lm):
    """Two tokens drawn at temperature 1 from the target's top 2 (4 outcomes, enumerated from the
    model), 600 choices in 6-slot requests beside each other (the second token from a cohort
    that rows keep joining): chi-square p > 0.001 (seeded). (The shortest prompt, read 100 times:
    its law's least cell is a fifth.)"""
    prompt = lm.encode(PROMPTS[0])[0]
    law = two_token_top2_law(lm.model, prompt, 1.0)
    counts = dict.fromkeys(law, 0)
    with Engine(lm, max_slots=12, max_length=256, seed=1) as engine:
        requests = [engine.submit(prompt, max_tokens=2, temperature=1.0, top_k=2, n=6, drafter=d)
                    for d in itertools.islice(itertools.cycle(["ngram", "stand"]), 100)]
        for request in requests:
            for choice in request.result(timeout=300):
                counts[tuple(choice.token_ids)] += 1
    observed = np.array([counts[k] for k in law])
    expected = np.array([law[k] for k in law])
    expected = expected / expected.sum() * observed.sum()
    assert observed.sum() == 600
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


def _spy_on_batches(monkeypatch) -> list:
    """The drafter and sampling values of every batch the engine's cohorts decode."""
    import stree.serving.engine as engine_module

    batches = []
    decode = engine_module.decode
    monkeypatch.setattr(engine_module, "decode", lambda *a, sampling, drafter, **k: batches.append(
        (type(drafter).__name__, sampling)) or decode(*a, sampling=sampling, drafter=drafter, **k))
    return batches


@pytest.mark.parametrize("drafter, tree", [("ngram", "auto"), ("stand", "full:2x1")])
def test_requests_of_different_temperatures_share_a_batch_and_keep_their_laws(lm, monkeypatch, drafter, tree):
    """Requests at temperatures 1.0, 0.6 and 0 (greedy) in turn (top 2, two tokens, 4 slots each):
    they decode in one cohort with each row's own values (STAND, on a root with two children each
    step, drawing them for the sampled rows and ranking them for the greedy ones); each sampled
    temperature's 400 choices fit its law, and every greedy choice is the greedy run's. (The shortest
    prompt, read 300 times: its laws' least cells are near a fifth.)"""
    batches = _spy_on_batches(monkeypatch)
    prompt = lm.encode(PROMPTS[0])[0]
    temperatures = (1.0, 0.6, 0.0)
    counts = {t: dict.fromkeys(two_token_top2_law(lm.model, prompt, t), 0) for t in temperatures[:2]}
    counts[0.0] = collections.Counter()
    with Engine(lm, max_slots=12, max_length=256, max_queue=300, seed=2) as engine:
        requests = [(t, engine.submit(prompt, max_tokens=2, temperature=t, top_k=2, n=4, drafter=drafter, tree=tree))
                    for t in itertools.islice(itertools.cycle(temperatures), 300)]
        for t, request in requests:
            for choice in request.result(timeout=300):
                counts[t][tuple(choice.token_ids)] += 1
        drafted = sum(steps for size, steps in engine.trees.items() if size > 1)
    # STAND's shared store, taught by the earlier requests, drafts most second tokens on the fixed
    # tree (the auto choice may find plain steps cheaper on a given machine)
    if tree != "auto":
        assert drafted >= 50
    assert any(params.rows is not None and set(params.temperature) == set(temperatures) for _, params in batches)
    greedy = generate(lm.model, [prompt], max_new_tokens=2, method="autoregressive").new_tokens[0]
    assert counts[0.0] == {tuple(greedy): 400}
    for t in temperatures[:2]:
        law = two_token_top2_law(lm.model, prompt, t)
        observed = np.array([counts[t][k] for k in law])
        expected = np.array([law[k] for k in law]) * observed.sum()
        assert observed.sum() == 400
        assert chisquare(observed, expected).pvalue > 1e-3, (t, observed, expected)


def test_greedy_requests_share_the_sampled_ones_batch_whatever_the_drafter(lm, monkeypatch):
    """Greedy requests beside sampled ones decode in one cohort per drafter (a batch of per-row
    values, greedy rows among them; STAND and the SSM drafter draw for the sampled rows and draft
    the greedy rows' likeliest tokens). Every greedy request is its solo run."""
    batches = _spy_on_batches(monkeypatch)
    drafters = ["ngram", None, "stand", "ssm"]
    jobs = [(PROMPTS[i], d, t) for i, (d, t) in enumerate(itertools.product(drafters, [0.0, 0.9]))]
    with Engine(lm, max_slots=8, max_length=512, seed=3) as engine:
        requests = [engine.submit(p, max_tokens=24, temperature=t, drafter=d) for p, d, t in jobs]
        results = [r.result(timeout=300)[0] for r in requests]
    mixed = {drafter for drafter, params in batches if params.some_greedy}
    assert mixed == {"NGramDrafter", "NoneType", "STANDDrafter", "SSMDrafter"}
    for (prompt, drafter, t), choice in zip(jobs, results):
        if t == 0:
            assert (choice.text, choice.token_ids) == _alone(lm, prompt, 24, drafter)[:2], drafter


def test_a_seeded_request_repeats_whatever_runs_beside_it(lm):
    with Engine(lm, max_slots=4, max_length=256, seed=0) as engine:
        alone = engine.submit(PROMPTS[3], max_tokens=24, temperature=0.8, seed=11).result(timeout=60)
        crowd = [engine.submit(p, max_tokens=24, temperature=0.8) for p in PROMPTS[:3]]
        again = engine.submit(PROMPTS[3], max_tokens=24, temperature=0.8, seed=11).result(timeout=60)
        [r.result(timeout=60) for r in crowd]
    assert alone[0].token_ids == again[0].token_ids


def test_a_seeded_request_draws_what_lm_generate_draws_with_its_seed_whatever_shares_its_cohort(lm):
    """Deterministic drafts (n-gram, STAND deterministic) at keyed draws: a seeded sampled request's
    choices are LM.generate's rows with that seed (choice i its row i), alone or joining a cohort
    of other requests (their rows sampled at other temperatures, seeded or not), across the cohort's
    restarts; a seeded request of random drafts (STAND's) still decodes in a cohort of its own."""
    kw = dict(temperature=0.8, top_p=1.0, top_k=0)
    want = {d: lm.generate([PROMPTS[3]] * 2, max_new_tokens=24, drafter=d, seed=11, **kw).token_ids
            for d in ("ngram", "stand-det")}
    with Engine(lm, max_slots=8, max_length=256, seed=0) as engine:
        for drafter in ("ngram", "stand-det"):
            alone = engine.submit(PROMPTS[3], max_tokens=24, n=2, drafter=drafter, seed=11, **kw).result(timeout=60)
            crowd = [engine.submit(p, max_tokens=24, drafter=drafter, temperature=t, seed=s)
                     for p, t, s in zip(PROMPTS[:3], (0.8, 0.3, 1.0), (None, 5, None))]
            joined = engine.submit(PROMPTS[3], max_tokens=24, n=2, drafter=drafter, seed=11, **kw)
            more = [engine.submit(p, max_tokens=8, drafter=drafter, temperature=0.5) for p in PROMPTS[4:6]]
            [r.result(timeout=60) for r in crowd + more]
            for got in (alone, joined.result(timeout=60)):
                assert [c.token_ids for c in got] == want[drafter], drafter
    with Engine(lm, max_slots=4, max_length=256, seed=0) as engine:
        own = engine.submit(PROMPTS[3], max_tokens=8, drafter="stand", seed=11, **kw)
        shared = engine.submit(PROMPTS[3], max_tokens=8, drafter="ngram", seed=11, **kw)
        assert own.settings.own is not None and shared.settings.own is None
        own.result(timeout=60), shared.result(timeout=60)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_tokens=0), ValueError, "max_tokens must be an int >= 1, got 0"),
    (dict(prompt_logprobs=-1), ValueError, "prompt_logprobs must be in"),
    (dict(max_tokens=1.5), ValueError, "max_tokens must be an int"),
    (dict(max_tokens=500), ValueError, "max_tokens=500 does not fit: a slot holds 256 tokens"),
    (dict(n=5), ValueError, "n must be at most max_slots"),
    (dict(temperature=-1), ValueError, "temperature"),
    (dict(top_p=0), ValueError, "top_p"),
    (dict(drafter="nope"), ValueError, "drafter must be one of"),
    (dict(drafter=3), TypeError, "drafter must be a drafter name"),
    (dict(stop=[""]), TypeError, "stop must be"),
    (dict(seed="1"), TypeError, "seed must be an int"),
    (dict(seed=-1), ValueError, r"seed must be in \[0, 2\*\*63\), got -1"),
    (dict(tree="bad"), ValueError, "bad tree spec"),
    (dict(prompt=[]), TypeError, "prompt must be"),
    (dict(prompt=[10**6]), ValueError, "not a token id"),
    (dict(logprobs=-1), ValueError, "logprobs must be in"),
    (dict(logprobs="2"), TypeError, "logprobs must be an integer"),
])
def test_bad_requests_are_refused_at_submit(lm, kwargs, error, match):
    with Engine(lm, max_slots=4, max_length=256) as engine:
        prompt = kwargs.pop("prompt", "def f(x):")
        with pytest.raises(error, match=match):
            engine.submit(prompt, **kwargs)
        assert engine.queue_length == 0 and engine.free_slots == 4


def test_engine_arguments_are_checked(lm):
    with pytest.raises(ValueError, match="max_slots must be an int in"):
        Engine(lm, max_slots=0)
    with pytest.raises(ValueError, match="max_length must be an int >= 2"):
        Engine(lm, max_length=1)
    with Engine(lm, max_length=256) as engine:
        assert 1 <= engine.max_slots <= 256  # sized from memory


def test_a_stand_store_outlives_the_requests_that_fill_it(lm):
    """Requests one after another (each cohort ends before the next starts) draft from one STAND
    store: what the first taught it is there for the second."""
    with Engine(lm, max_slots=2, max_length=256, seed=0) as engine:
        engine.submit(PROMPTS[0], max_tokens=16, drafter="stand").result(timeout=60)
        (store,) = {id(d.store): d.store for d in engine._drafters.values()}.values()
        filled = len(store)
        assert filled > 0
        engine.submit(PROMPTS[1], max_tokens=16, drafter="stand").result(timeout=60)
        assert [d.store for d in engine._drafters.values()] == [store] and len(store) > filled


def test_a_growing_cohort_measures_the_costs_of_powers_of_two_only(lm, monkeypatch, tmp_path):
    """Rows joining one by one restart their cohort at every size from 1 to 7: the costs of 1, 2, 4
    and 8 rows are measured (each a pause of the whole engine), the sizes between interpolated;
    outputs stay each request's own."""
    from stree.decoding import cost
    import stree.serving.engine as engine_module

    monkeypatch.setenv("STREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost, "_MEMO", {})
    measured, chosen, watching = [], [], []

    def measure(model, drafter, batch, mode, sampled, shapes, budget_s, scan):
        measured.append(batch)  # trees priced cheaply, so that the cohorts draft them
        return cost.CostProfile(1.0, tuple(s.n for s in shapes), tuple(1.0 + 0.01 * s.n for s in shapes))

    def auto_tree(model, drafter, batch, **kw):
        chosen.append(batch)
        watching.append(kw.get("watch"))
        return real_auto_tree(model, drafter, batch, **kw)

    real_auto_tree = engine_module.auto_tree
    monkeypatch.setattr(cost, "_measure", measure)
    monkeypatch.setattr(engine_module, "auto_tree", auto_tree)
    with Engine(lm, max_slots=8, max_length=512, seed=0) as engine:
        requests = []
        for i in range(7):
            requests.append(engine.submit(PROMPTS[i % len(PROMPTS)], max_tokens=48, drafter="ngram"))
            next(iter(requests[-1]))  # its first token: it joins the cohort at the next iteration
        results = [r.result(timeout=120) for r in requests]
    assert set(chosen) - {1, 2, 4, 8}, chosen  # the cohort ran at sizes between powers of two
    assert set(measured) <= {1, 2, 4, 8}, measured
    assert watching and all(watching)  # greedy cohorts of a drafter without a model watch drafts, as decode does
    for i, result in enumerate(results):
        assert result[0].text == _alone(lm, PROMPTS[i % len(PROMPTS)], 48, "ngram")[0]
