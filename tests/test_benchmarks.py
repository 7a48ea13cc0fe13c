import importlib.util
import inspect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stree.kernels.cpu import mamba_step
from stree.tools.timing import run_info

ROOT = Path(__file__).resolve().parents[1]
# where the benchmarks run by default (stree.tools.timing.device_and_dtype), and the library's models
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def benchmark(name: str):
    """``benchmarks/{name}.py`` loaded as a module (its functions, and ``main`` for bad input)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smoke(name, tmp_path, *args, process=False):
    """Run ``benchmarks/{name}.py --smoke`` (and ``args``); its JSON, after the checks every result
    must pass. In this process, as the script's own ``main`` (a process of its own would import
    torch and stree again for each benchmark; the thread count and random state are put back
    after), or with ``process`` as a command (a benchmark whose ranks are processes that import
    its functions by their module's name)."""
    argv = ["--smoke", "--out", str(tmp_path), *args]
    script = ROOT / "benchmarks" / f"{name}.py"
    if process:
        run = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
    else:
        module = benchmark(name)
        threads, rng = torch.get_num_threads(), torch.get_rng_state()
        try:
            code = module.main(argv)
        finally:
            torch.set_num_threads(threads)
            torch.set_rng_state(rng)
        assert code is None or isinstance(code, dict) or code in (0, True), code  # (a main returning its status)
    result = json.loads((tmp_path / f"{name}_smoke.json").read_text())
    assert result["device"] and result["date"] and "--smoke" in result["command"]
    assert (tmp_path / f"{name}_smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result


def test_device_and_dtype_options():
    """--device / --dtype of the GPU-ready benchmarks (acceptance, e2e): checked, with defaults by
    device; the smoke runs record the dtype they ran in."""
    import argparse

    from stree.tools.timing import add_device_args, device_and_dtype

    parser = argparse.ArgumentParser()
    add_device_args(parser)
    assert device_and_dtype(parser.parse_args(["--device", "cpu", "--dtype", "bfloat16"])) == (torch.device("cpu"),
                                                                                             torch.bfloat16)
    assert device_and_dtype(parser.parse_args(["--device", "cpu"]))[1] == torch.float32
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            device_and_dtype(parser.parse_args(["--device", "cuda"]))


def test_tree_scan_sweep_smoke_writes_consistent_json_and_png(tmp_path):
    result = smoke("tree_scan_sweep", tmp_path)
    rows = result["results"]
    assert {r["tree"] for r in rows} >= {"chain5", "paper13"}
    for r in rows:
        assert r["max_rel_diff_vs_tree_scan"] <= 1e-5, r
        assert r["time_ms_median"] > 0
        if r["method"] == "tree_scan":
            assert r["states_held"] == 1 and r["tokens_computed"] == r["nodes"]
        else:
            assert r["states_held"] == r["leaves"] and r["tokens_computed"] >= r["nodes"]
    paper = {r["method"]: r for r in rows if r["tree"] == "paper13"}
    assert paper["unrolled_multistep"]["tokens_computed"] == 7 * 5  # 7 leaf paths padded to depth 4 + root


def test_model_forward_smoke_writes_json_and_png(tmp_path):
    result = smoke("model_forward", tmp_path)
    rows = result["results"]
    assert {r["model"] for r in rows} == {"mamba2-tiny", "mil-tiny"}
    for model in ("mamba2-tiny", "mil-tiny"):
        ours = [r for r in rows if r["model"] == model]
        step = [r for r in ours if r["backend"] == "step"]
        assert len(step) == 1 and step[0]["ratio_to_step"] == 1.0
        for tree in ("chain5", "paper13", "binary15", "binary31", "binary63"):
            for backend in ("tree", "unrolled", "unrolled-full"):
                (r,) = [r for r in ours if r["tree"] == tree and r["backend"] == backend]
                assert r["time_ms_median"] > 0  # peak memory: measured on CUDA only
                assert abs(r["ratio_to_step"] - r["time_ms_median"] / step[0]["time_ms_median"]) < 1e-9
        full = {r["tree"]: r["tokens"] for r in ours if r["backend"] == "unrolled-full"}
        assert full["binary15"] == 32 and full["binary63"] == 192  # 8 paths of 4, 32 paths of 6 (paper 001 Table 2)


def test_drafting_smoke_writes_json_and_png(tmp_path):
    result = smoke("drafting", tmp_path)
    assert result["tree_nodes"] == 81
    rows = result["results"]
    assert {r["drafter"] for r in rows} == {"ngram", "stand", "stand_deterministic", "consensus"}
    assert {r["context"] for r in rows} == {64, 256}
    for r in rows:
        assert 0 < r["step_us_min"] <= r["step_us_median"]
        assert r["store_size"] is None or r["store_entries"] >= r["store_size"]


def test_acceptance_smoke_writes_json_table_and_png(tmp_path):
    result = smoke("acceptance", tmp_path, "--dtype", "float32")  # on CUDA too: identity is checked
    rows = result["results"]
    names = ("ngram", "stand", "stand-det", "consensus", "ssm-static", "ssm-beam", "stand@paper13",
             "stand-det@paper13", "stand@dynamic:81", "stand-det@dynamic:81", "ssm-static@dynamic:20x5w3",
             "consensus-paper")
    assert [(r["drafter"], r["temperature"], r["trajectories"]) for r in rows] == [
        (d, t, n) for d in names for t in (0.0, 0.6, 1.0) for n in (1, 2)]
    assert all(r["tau"] >= 1.0 and r["config_tokens_per_s"] > 0 for r in rows)
    assert result["dtype"] == "float32"
    greedy_stand = {r["trajectories"]: r["tau"] for r in rows if r["drafter"] == "stand-det" and r["temperature"] == 0}
    assert greedy_stand[2] > greedy_stand[1]  # the second greedy trajectory drafts from the first's store
    table = (tmp_path / "acceptance_smoke.md").read_text()
    assert "| stand | 0.6 |" in table and table.count("\n|") == 2 + len(names) * 3



def test_ngram_matches_smoke_shares_accepted_drafts_by_match_length(tmp_path):
    result = smoke("ngram_matches", tmp_path)
    stand = smoke("ngram_matches", tmp_path, "--drafter", "stand-det", "--stem", "ngram_matches_smoke")
    assert (result["drafter"], stand["drafter"]) == ("ngram", "stand-det") and result["other"] != stand["other"]
    for rows in (result["results"], stand["results"]):
        assert rows and all(1 <= r["match"] <= 4 and isinstance(r["other"], bool) and isinstance(r["below_weak"], bool)
                            for r in rows)
        # (a first child has nothing above it)
        assert all(r["first_reached"] == 0 for r in rows if r["below_weak"])
        assert all(0 <= r["accepted"] <= r["reached"] and r["share"] == r["accepted"] / r["reached"] for r in rows)
        assert all(r["first_accepted"] <= r["first_reached"] <= r["reached"] for r in rows)
        assert sum(r["first_reached"] for r in rows) > 0  # (a chain's first child is reached at every step)


def test_ngram_matches_follow_the_path():
    """The length of the context suffix each chain node's token continued, the path's drafted tokens
    taking part in the suffix (0 where the token never followed any), and whether other tokens followed
    that suffix too."""
    module = benchmark("ngram_matches")
    context = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    # root 3; then 4 after (1, 2, 3) alone; then 9 after (1, 2, 3, 4); then 7, which never occurred
    assert module.matches(context, [3, 4, 9, 7], 4) == [(3, False), (4, False), (0, False)]
    assert module.matches(context, [3, 5], 4) == [(2, True)]  # (2, 3) -> 4 and 5; (1, 2, 3) -> 4 alone

def test_e2e_smoke_compares_every_configuration_with_transformers(tmp_path, monkeypatch):
    import stree.models.layers.linear as lin

    # (one product path: which one "auto" measures fastest varies between processes, and with it the
    # step's op counts, 17 to 26 on one machine, the tree pass's 25)
    monkeypatch.setattr(lin, "PATH", "blas")
    result = smoke("e2e", tmp_path, "--dtype", "float32")
    rows = {r["name"]: r for r in result["results"]}
    assert {"transformers", "stree-autoregressive", "stree-ngram", "stree-ssm-static", "chain-ngram",
            "stree-ssm-static-dynamic", "stree-stand-det-dynamic"} <= set(rows)
    assert rows["transformers"]["speedup_vs_transformers"] == 1.0
    assert result["dtype"] == "float32"
    for r in rows.values():
        assert r["identical_to_transformers"], r["name"]  # greedy: token for token
        assert r["tokens_per_s"] > 0
        if r["name"] != "transformers":
            assert r["tau"] >= 1.0 and r["ms_per_iteration"]["verify"] > 0
    ops = result["op_counts"]
    # (counted, each: a tree pass may take fewer compute ops than a step, its conv's and gate's SiLU one
    # op where a step's gate has one of its own; the budgets are tests/models/test_op_budgets.py's)
    assert ops["step"]["compute"] > 0 and ops["forward_tree"]["compute"] > 0 and ops["commit"]["total"] > 0


def test_reasoning_smoke_compares_specreason_with_the_base_model(tmp_path):
    result = smoke("reasoning", tmp_path)
    assert "tiny code models" in result["note"] and "not reasoning accuracy" in result["note"]
    rows = {r["name"]: r for r in result["results"]}
    assert rows["base"]["speedup_vs_base"] == 1.0 and "base+stree" in rows
    for judge, thresholds in (("prompt", (3, 5, 7)), ("logprob", (-3, -2, -1))):
        for t in thresholds:
            r = rows[f"specreason-{judge}@{t}"]
            assert r["judged"] >= 1 and 0 <= r["accepted"] <= r["judged"] and r["judge_forwards"] == r["judged"]
            assert r["small_tokens"] >= 1 and r["tokens"] == rows["base"]["tokens"]  # the same budget, spent
    assert {r["shared_store"] for r in result["search"]["rows"]} == {True, False}


def test_tensor_parallel_smoke_times_every_op_at_every_world_size(tmp_path):
    result = smoke("tensor_parallel", tmp_path, process=True)
    rows = result["results"]
    assert result["backend"] == "gloo" and result["dtype"] == "float32"
    for model in ("mamba2-tiny", "mil-tiny"):
        for op in ("step", "tree paper13", "tree binary63"):
            got = {r["world"]: r for r in rows if r["model"] == model and r["op"] == op}
            assert set(got) == {1, 2} and all(r["time_ms_median"] > 0 for r in got.values())
            assert got[1]["speedup_vs_world_1"] == 1.0
            assert got[2]["weight_bytes_per_rank"] < 0.7 * got[1]["weight_bytes_per_rank"]  # each rank a slice
            assert got[2]["cache_bytes_per_rank"] < 0.7 * got[1]["cache_bytes_per_rank"]
            assert abs(got[2]["speedup_vs_world_1"] - got[1]["time_ms_median"] / got[2]["time_ms_median"]) < 1e-9


def test_speculation_smoke_reports_gains_over_autoregressive(tmp_path):
    result = smoke("speculation", tmp_path)
    assert result["target"] == "the shipped target"
    rows = result["results"]
    assert {r["drafter"] for r in rows} == {"autoregressive", "autoregressive again", "ngram", "ssm"}
    ar = next(r for r in rows if r["drafter"] == "autoregressive")
    assert ar["gain"] == 1.0 and ar["trees"] == {"1": ar["trees"]["1"]} and ar["tau"] == 1.0
    again = next(r for r in rows if r["drafter"] == "autoregressive again")  # the noise control: the same work
    assert again["trees"] == ar["trees"] and again["tau"] == 1.0 and again["gain"] > 0
    for r in rows:
        assert r["identical"] is True and r["tokens"] == 2 * 8
        assert sum(r["trees"].values()) > 0 and r["gain"] > 0 and r["step_in_ar_steps"] > 0
        assert set(r["call_ms"]) == {"setup", "prefill", "loop", "outside"} and r["call_ms"]["loop"] > 0
        assert r["call_ms"]["setup"] > 0  # (every eager call measures its products' paths: the tree choice's too)
        # two turns (one round of two prompts), as many tokens each: the pooled gain lies between the
        # turns' paired ones
        turns = r["gain_turns"]
        assert turns["turns"] == 2 and turns["min"] <= turns["q25"] <= turns["median"] <= turns["q75"] <= turns["max"]
        assert turns["min"] * (1 - 1e-9) <= r["gain"] <= turns["max"] * (1 + 1e-9)
    assert ar["gain_turns"]["min"] == ar["gain_turns"]["max"] == 1.0


def test_speculation_decodes_with_the_shipped_drafter_as_the_target(tmp_path):
    """``--target drafter``: the 1-layer drafter decodes (a cheap step: the loop's host work weighs
    as on a GPU), said in the result; the ssm drafter, which would need a smaller model, is left out."""
    result = smoke("speculation", tmp_path, "--target", "drafter")
    assert result["target"] == "the shipped drafter"
    rows = result["results"]
    assert {r["drafter"] for r in rows} == {"autoregressive", "autoregressive again", "ngram"}
    assert all(r["identical"] is True and r["tokens"] == 2 * 8 for r in rows)


def test_speculation_runs_each_drafter_beside_fixed_trees_too(tmp_path):
    """``--trees``: every drafter also drafts each given tree every step ("<drafter>@<spec>"), in
    every group (two batch sizes here), its outputs the autoregressive ones; a bad spec is refused
    before anything runs."""
    module = benchmark("speculation")
    result = module.main(["--prompts", "2", "--max-new-tokens", "8", "--batches", "1,2", "--temperatures", "0",
                          "--modes", "eager", "--drafters", "ngram,ssm", "--rounds", "1", "--trees", "chain:2",
                          "--out", str(tmp_path)])
    for batch in (1, 2):
        rows = [r for r in result["results"] if r["batch"] == batch]
        fixed = {r["drafter"]: r for r in rows if "@" in r["drafter"]}
        assert set(fixed) == {"ngram@chain:2", "ssm@chain:2"}
        for r in fixed.values():  # (a 3-node chain wherever the drafter drafted)
            trees = {int(n): k for n, k in r["trees"].items()}
            assert set(trees) <= {1, 3} and trees.get(3, 0) > 0 and r["identical"] is True
        assert set(fixed["ssm@chain:2"]["trees"]) == {3}  # (a drafter model always drafts)
    with pytest.raises(ValueError, match="bogus"):
        module.main(["--smoke", "--trees", "bogus", "--out", str(tmp_path)])


def test_speculation_floor_runs_each_drafter_with_a_choice_that_never_drafts(tmp_path):
    """``--floor``: every drafter also decodes with a choice that never drafts ("<drafter> never
    drafting"): every step plain, nothing watched or probed, the output autoregressive decoding's."""
    module = benchmark("speculation")
    floor = module.NeverDrafts()
    assert floor.plan() is None and floor.plain_ahead() == floor.NEVER and floor.watch_shape() is None
    result = module.main(["--prompts", "2", "--max-new-tokens", "24", "--batches", "1", "--temperatures", "0",
                          "--modes", "eager", "--drafters", "ngram,ssm", "--rounds", "1", "--floor",
                          "--out", str(tmp_path)])
    rows = {r["drafter"]: r for r in result["results"]}
    plain = rows["autoregressive"]["trees"]
    for name in ("ngram never drafting", "ssm never drafting"):
        assert rows[name]["trees"] == plain and rows[name]["identical"] is True
        assert rows[name]["watched"] == 0 and rows[name]["tau"] == 1.0 and rows[name]["gain"] > 0


def test_choice_ab_smoke_pairs_the_working_trees_choice_with_a_revisions(tmp_path):
    """The working tree's choice against HEAD's, in a fresh process: both gains over autoregressive
    decoding and their difference; a config or revision it cannot run is a clear error."""
    result = smoke("choice_ab", tmp_path)
    (row,) = result["results"]
    (run,) = row["processes"]
    assert row["config"] == "eager 1 0 ngram" and result["against"] == "HEAD"
    assert set(run["gains"]) == {"against", "working"} and all(g > 0 for g in run["gains"].values())
    assert set(run["seconds"]) == {"autoregressive", "against", "working"} and all(run["seconds"].values())
    assert row["difference"]["mean"] == pytest.approx(run["gains"]["working"] - run["gains"]["against"])
    assert all(sum(t.values()) > 0 for t in run["trees"].values())  # (each choice decoded and counted its steps)
    module = benchmark("choice_ab")
    for bad in ("eager 1 0", "cuda 1 0 ngram", "eager two 0 ngram", "eager 0 0 ngram"):
        with pytest.raises(ValueError, match="config"):
            module.main(["--configs", bad, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--against 'no-such-revision'"):
        module.main(["--against", "no-such-revision", "--processes", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--stale must be > 0, got 0.0"):
        module.main(["--stale", "0", "--out", str(tmp_path)])
    measured = {"format": 1, "entries": {"k": {"value": {"step_ms": 1.0, "nodes": [2], "tree_ms": [1.5],
                                                         "draft_ms": [0.25], "catch_ms": 0.5, "depths": []}}}}
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    module.stale_file(tmp_path / "measured.json", 4.0, tmp_path / "stale.json")
    value = json.loads((tmp_path / "stale.json").read_text())["entries"]["k"]["value"]
    assert value == {"step_ms": 4.0, "nodes": [2], "tree_ms": [6.0], "draft_ms": [1.0], "catch_ms": 2.0, "depths": []}


def test_host_gap_smoke_times_each_call_after_each_wait(tmp_path):
    """A step, a tree pass and the control (plain PyTorch products) after each busy wait, each against itself without
    one, and the calls after it (``--after``) against the call's steady state; a tree, round,
    after count or wait it cannot run is a clear error."""
    result = smoke("host_gap", tmp_path, "--after", "3")
    rows = result["results"]
    calls = ("step", "tree", "products")
    assert [(r["call"], r["gap_ms"]) for r in rows] == [(c, g) for c in calls for g in (0.0, 0.4)]
    assert all(r["median_ms"] > 0 for r in rows)
    for r in rows:
        base = next(b for b in rows if b["call"] == r["call"] and b["gap_ms"] == 0.0)
        assert r["over_no_gap"] == pytest.approx(r["median_ms"] / base["median_ms"])
        assert len(r["following"]) == 2 and all(x > 0 for x in r["following"])
    # (the no-wait row's last call is the steady state the others are taken over)
    assert all(r["following"][-1] == 1.0 for r in rows if r["gap_ms"] == 0.0)
    assert rows[0]["in_steps_without_gap"] == 1.0 and result["nodes"] == 8 and result["after"] == 3
    module = benchmark("host_gap")
    for bad in (["--nodes", "1"], ["--rounds", "0"], ["--after", "0"], ["--gaps", "x"], ["--gaps", "-1"]):
        with pytest.raises(SystemExit) as exc:
            module.main([*bad, "--out", str(tmp_path)])
        assert exc.value.code == 2


def test_cost_smoke_tables_every_size_in_steps_and_the_drafters_step(tmp_path):
    result = smoke("cost", tmp_path)
    rows = result["results"]
    assert [r["nodes"] for r in rows] == [1, 2, 4, 8] and rows[0]["in_steps"] == 1.0
    assert all(r["target_ms"] > 0 and r["in_steps"] > 0 for r in rows)
    (d,) = result["drafter_steps"]
    assert (d["target_layers"], d["drafter_layers"]) == (2, 1)
    assert d["ratio"] == pytest.approx(d["drafter_step_ms"] / d["target_step_ms"]) and d["ratio"] > 0


def test_cost_takes_the_sizes_asked_for_and_refuses_bad_ones(tmp_path):
    result = smoke("cost", tmp_path, "--sizes", "3,66")
    assert [r["nodes"] for r in result["results"]] == [1, 3, 66]
    script = ROOT / "benchmarks" / "cost.py"
    for bad in ("1,4", "4,x"):
        run = subprocess.run([sys.executable, str(script), "--smoke", "--sizes", bad, "--out", str(tmp_path)],
                             capture_output=True, text=True)
        assert run.returncode == 2 and "--sizes must be" in run.stderr and "Traceback" not in run.stderr


def test_iteration_trace_smoke_counts_per_iteration(tmp_path):
    """One profiled generate call per configuration: per-iteration figures, and a speculative
    configuration's tree passes among its iterations."""
    result = smoke("iteration_trace", tmp_path)
    rows = {r["name"]: r for r in result["results"]}
    assert set(rows) == {"autoregressive", "ngram-paper13", "ngram-auto"}
    for r in rows.values():
        assert r["iterations"] >= 1 and r["wall_ms"] > 0 and r["top_host"]
        assert r["tokens"] == result["tokens"]
    assert rows["autoregressive"]["trees"] == {"1": rows["autoregressive"]["iterations"]}  # JSON keys
    assert 13 in {int(n) for n in rows["ngram-paper13"]["trees"]}


def test_autotree_trace_smoke_logs_every_iteration_of_the_timed_calls(tmp_path):
    """Each iteration of the timed calls is logged once, under one kind (autoregressive decoding
    has no chooser: none), and the kinds' shares of the loop add up."""
    import stree.decoding.autotree as autotree
    import stree.decoding.loop as loop

    wrapped = (loop._Loop.iterate, loop.autoregressive_step, loop.speculative_step, autotree.AutoTree.record,
               autotree.AutoTree.plain_steps)
    result = smoke("autotree_trace", tmp_path)
    assert (loop._Loop.iterate, loop.autoregressive_step, loop.speculative_step, autotree.AutoTree.record,
            autotree.AutoTree.plain_steps) == wrapped  # (its wrappers came off: later tests run the loop as it is)
    rows = {r["drafter"]: r for r in result["results"]}
    assert set(rows) == {"autoregressive", "ngram"} and rows["autoregressive"]["kinds"] == []
    assert result["compiled"] is False  # (--compiled: torch_compile=True, the result says so)
    ngram = rows["ngram"]
    calls = result["prompts"]  # batch 1
    assert sum(k["iterations"] for k in ngram["kinds"]) == round(ngram["steps_per_call"] * calls)
    assert {k["kind"] for k in ngram["kinds"]} <= {"plain", "run", "probe", "tree"}
    assert sum(k["share_of_loop"] for k in ngram["kinds"]) == pytest.approx(1.0)
    assert all(k["clock_ms"] > 0 and k["predicted_ms"] > 0 and k["emitted"] >= 1 for k in ngram["kinds"])
    # the loop's host time outside the model: every iteration once, autoregressive ones as steps, the
    # chooser's kinds as it logged them (its probes among the trees)
    assert list(rows["autoregressive"]["host"]) == ["step"]
    assert rows["autoregressive"]["host"]["step"]["iterations"] == round(rows["autoregressive"]["steps_per_call"] * calls)
    logged = {kind: sum(k["iterations"] for k in ngram["kinds"] if k["kind"] == kind) for kind in ("plain", "run")}
    logged["tree"] = sum(k["iterations"] for k in ngram["kinds"] if k["kind"] in ("probe", "tree"))
    assert {kind: h["iterations"] for kind, h in ngram["host"].items()} == {k: n for k, n in logged.items() if n}
    assert all(h["host_ms"] > 0 for r in rows.values() for h in r["host"].values())


def test_autotree_sim_is_the_same_in_every_run_and_follows_its_table(tmp_path):
    """The virtual clock: every output autoregressive decoding's, and the same gains, tree shares and
    tau in two runs (nothing of the machine enters); trees that cost what a plain step does are
    taken wherever n-gram drafts and gain, trees of twenty steps are not; a bad table is one line and
    exit 2."""
    first = smoke("autotree_sim", tmp_path, "--max-new-tokens", "48")
    again = smoke("autotree_sim", tmp_path, "--max-new-tokens", "48")
    rows = first["results"]
    assert [r["drafter"] for r in rows] == ["autoregressive", "ngram", "stand-det"]
    assert all(r["identical"] for r in rows) and rows[0]["gain"] == 1.0
    key = lambda result: [(r["gain"], r["tree_share"], r["tau"]) for r in result["results"]]  # noqa: E731
    assert key(first) == key(again)
    cheap = smoke("autotree_sim", tmp_path, "--max-new-tokens", "48", "--passes", "2:1.0,4:1.0,8:1.0,16:1.0",
                  "--draft", "0", "--after", "")["results"]
    dear = smoke("autotree_sim", tmp_path, "--max-new-tokens", "48", "--passes", "2:20,16:20")["results"]
    assert cheap[1]["tree_share"] > 0.3 and cheap[1]["gain"] > 1.15  # (n-gram: where it has a draft)
    assert dear[1]["tree_share"] < 0.1 and dear[1]["gain"] <= 1.0
    assert not first["measured"] and first["passes"] == {"2": 2.7, "4": 2.9, "8": 3.2, "16": 3.8}  # (the default)
    script = ROOT / "benchmarks" / "autotree_sim.py"
    for flag, bad in (("--passes", "1:2"), ("--passes", "2-3"), ("--after", "1.2,x"), ("--draft", "0.2 --measured")):
        run = subprocess.run([sys.executable, str(script), "--smoke", flag, *bad.split(), "--out", str(tmp_path)],
                             capture_output=True, text=True)
        assert run.returncode == 2 and f"{flag} " in run.stderr and "Traceback" not in run.stderr


def test_autotree_sim_measured_takes_its_table_from_the_machine(tmp_path, monkeypatch):
    """--measured: the passes and drafting are a cost profile measured on this machine (afresh),
    each iteration over its plain step, times the tree scale the n-gram drafter's choice learned
    from the clock decoding the prompts for real; the result records both; outputs stay
    autoregressive decoding's."""
    import stree.decoding.autotree as autotree
    from stree.decoding.cost import CostProfile, default_sizes

    made = []
    measure = autotree.cost_profile

    def spy(*args, **kwargs):
        made.append((kwargs, measure(*args, **kwargs)))
        return made[-1][1]

    monkeypatch.setattr(autotree, "cost_profile", spy)
    result = smoke("autotree_sim", tmp_path, "--measured", "--drafters", "ngram")
    assert made[0][0]["refresh"] and made[0][0]["mode"] == "eager"  # measured afresh first, not the file's
    profile, scale = CostProfile.from_dict(result["measured"]["profile"]), result["measured"]["tree_scale"]
    assert profile in [p for _, p in made] and 0 < scale < 10  # (a profile the machine measured, the loop's)
    assert result["passes"] == {str(n): pytest.approx(t / profile.step_ms * scale)
                                for n, t in zip(profile.nodes, profile.tree_ms)}
    assert result["draft"] == pytest.approx(statistics.median(profile.draft_ms) / profile.step_ms * scale)
    sizes = list(map(int, result["passes"]))  # (eager, the device's sizes: those measured within the profile's budget)
    assert len(sizes) >= 2 and sizes == list(default_sizes(DEVICE))[: len(sizes)]
    assert result["after"] == [1.3, 1.3, 1.35, 1.19, 1.14, 1.09]  # (the first plain step after a tree: in the scale)
    assert all(r["identical"] for r in result["results"])


def test_iteration_parts_smoke_times_each_part_in_steps(tmp_path):
    result = smoke("iteration_parts", tmp_path)
    (row,) = result["results"]
    assert row["nodes"] == 13 and row["in_steps"]["step"] == 1.0
    assert set(row["in_steps"]) == {"step", "tree_pass", "pass_and_verify", "speculative_step", "separate_calls",
                                    "products_added", "in_pass_layer_in", "in_pass_layer_out", "in_pass_norms"}
    # (times only: which part took longer is the benchmark's to say, and a loaded machine reorders
    # a smoke's few runs: a pass once took 13 ms against the whole step's 1.5 beside other tests;
    # the differences of two such times may come out either way in a smoke)
    differences = [row["ms"].pop(k) for k in ("products_added", "in_pass_layer_in", "in_pass_layer_out",
                                              "in_pass_norms")]
    assert all(v > 0 for v in row["ms"].values()) and all(map(math.isfinite, differences))


def test_iteration_parts_times_the_pass_without_each_part_then_puts_its_kernels_back():
    """``in_pass_<part>``: the pass with exactly that part's bound kernels writing zeros to their
    outputs, the real ones back afterwards (a benchmark that left them replaced would corrupt every
    pass after it in the process); the parts are the kernels a pass calls, serial (a layer's two
    compiled calls) or in parallel, each kernel's named outputs at the arguments it writes."""
    module = benchmark("iteration_parts")
    from stree.kernels.cpu import bound

    real = {name: getattr(bound, name) for kernels in module.IN_PASS.values() for name in kernels}
    for kernels in module.IN_PASS.values():
        seen = {}
        arguments = {name: [np.ones(3, dtype=np.float32) for _ in range(22)] for name in kernels}

        def during():
            seen.update({name: getattr(bound, name) is kernel for name, kernel in real.items()})
            for name in kernels:
                getattr(bound, name)(*arguments[name])

        module._without(kernels, during)()
        assert seen == {name: name not in kernels for name in real}
        for name, outputs in kernels.items():
            zeroed = {i % 22 for i in outputs}
            assert all(not a.any() if i in zeroed else a.all() for i, a in enumerate(arguments[name])), name
    assert all(getattr(bound, name) is kernel for name, kernel in real.items())
    # the positions are the kernels' output parameters (their names, from the compiled functions' signatures)
    from stree.kernels.cpu import layer_jit, norm_jit, tree_jit

    written = {"tree_layer_in": {"xBC", "dt", "conv", "gate"}, "tree_layer_out": {"x", "B", "out"},
               "tree_conv_rows": {"out"}, "tree_scan_rows": {"y"}, "gated_rms_norm_rows": {"out"},
               "rms_norm_rows": {"out"}}
    for kernels in module.IN_PASS.values():
        for name, outputs in kernels.items():
            fn = getattr(layer_jit, name, None) or getattr(tree_jit, name, None) or getattr(norm_jit, name)
            params = list(inspect.signature(getattr(fn, "py_func", fn)).parameters)
            assert {params[i] for i in outputs} == written[name], name


def test_iteration_parts_classes_say_what_each_kind_of_iteration_gained_or_lost():
    """The loop's iterations by class: counts, medians in autoregressive iterations, and shares of
    autoregressive decoding's time that, with the count difference's, sum to the time ratio less one."""
    module = benchmark("iteration_parts")
    autoregressive = [1.0, 1.0, 1.0, 1.0, 2.0]  # mean 1.2, median 1.0, total 6.0
    kinds = {"tree": [3.0, 3.0], "plain_run": [1.0], "plain+watch": [2.0]}
    out = module.classes(kinds, autoregressive)
    assert out["tree"] == dict(count=2, in_steps=3.0, beyond=pytest.approx((6.0 - 2 * 1.2) / 6.0))
    assert out["plain_run"]["beyond"] == pytest.approx(-0.2 / 6.0) and out["plain+watch"]["in_steps"] == 2.0
    assert out["iterations"] == pytest.approx((4 - 5) * 1.2 / 6.0) and out["time_ratio"] == pytest.approx(9.0 / 6.0)
    shares = sum(v["beyond"] for v in out.values() if isinstance(v, dict)) + out["iterations"]
    assert shares == pytest.approx(out["time_ratio"] - 1.0)


def test_iteration_parts_transitions_are_medians_by_the_iteration_before():
    module = benchmark("iteration_parts")
    pairs = {"tree after plain": [3.0, 5.0, 4.0], "plain after tree": [2.0]}
    out = module.transitions(pairs, [2.0, 2.0, 4.0])  # (median 2.0)
    assert out == {"plain after tree": dict(count=1, in_steps=1.0), "tree after plain": dict(count=3, in_steps=2.0)}


def test_serve_smoke_measures_both_modes_through_the_server(tmp_path):
    result = smoke("serve", tmp_path)
    # where and how the server ran: the benchmarks' defaults (the GPU in bfloat16 where there is one)
    assert result["device"] == run_info(DEVICE)["device"]
    assert result["dtype"] == ("bfloat16" if DEVICE.type == "cuda" else "float32")
    rows = result["results"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [(m, c) for c in (1, 2)
                                                             for m in ("autoregressive", "speculative")]
    for r in rows:
        assert r["requests"] == 2 * r["concurrency"] and r["tokens"] == 8 * r["requests"]
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tokens_per_s"] > 0 and r["tau"] >= 1
    assert all(r["gain_over_autoregressive"] > 0 for r in rows if r["mode"] == "speculative")


def test_mixed_sampling_smoke_runs_every_batching_and_puts_the_key_back(tmp_path):
    from stree.serving import engine

    key = engine._Settings.cohort
    result = smoke("mixed_sampling", tmp_path)
    rows = result["results"]
    drafters = ("autoregressive", "n-gram", "stand", "ssm")
    assert [(r["drafter"], r["batching"]) for r in rows] == [(d, b) for d in drafters
                                                             for b in ("one batch", "greedy apart", "apart")]
    assert all(r["tokens"] == 2 * 4 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["gain_over_apart"] == 1.0 for r in rows if r["batching"] == "apart")
    assert all(r["gain_over_greedy_apart"] == 1.0 for r in rows if r["batching"] == "greedy apart")
    assert engine._Settings.cohort is key and result["temperatures"] == [0.0, 1.0]


def test_engine_load_smoke_runs_every_way_and_puts_the_switch_back(tmp_path):
    from stree.serving import Engine

    result = smoke("engine_load", tmp_path)
    rows = result["results"]
    assert [(r["drafter"], r["concurrency"]) for r in rows] == [(d, c) for d in ("autoregressive", "n-gram")
                                                                for c in (1, 2)]
    for r in rows:
        assert len(r["tokens_per_s"]) == 3 and all(v > 0 for v in r["tokens_per_s"].values())
        assert r["together_over_apart"] > 0 and r["engine_over_generate"] > 0
    assert Engine.GROUP_PREFILLS is True


def test_slot_memory_smoke_sizes_slots_from_the_models_own_caches(tmp_path):
    result = smoke("slot_memory", tmp_path, "--mean-tokens", "64")
    rows = {r["model"]: r for r in result["results"]}
    assert set(rows) == {"mamba2-tiny", "mil-tiny"} and result["mean_tokens"] == 64
    ssm, hybrid = rows["mamba2-tiny"], rows["mil-tiny"]
    assert ssm["kv_mib"] == 0 and ssm["slots_blocks"] == ssm["slots_preallocated"] > 0  # no KV: nothing to page
    # 64-token requests in 256-token slots: blocks hold the state and a quarter of the KV
    ratio = 1 / ((1 - hybrid["kv_share"]) + hybrid["kv_share"] / 4)  # a preallocated slot's bytes over a paged one's
    assert hybrid["slots_blocks"] == pytest.approx(hybrid["slots_preallocated"] * ratio, rel=1e-3)


def test_pass_ab_smoke_prices_a_tree_pass_in_steps_for_the_working_tree_and_a_revision(tmp_path):
    """A fresh process of each side, each from its own stree (checked by the script); a config or
    revision it cannot run is a clear error."""
    result = smoke("pass_ab", tmp_path)
    tree, packed = result["results"]
    assert (tree["batch"], tree["nodes"], tree["row_sizes"]) == (1, 2, None) and result["against"] == "HEAD"
    assert (packed["batch"], packed["nodes"], packed["row_sizes"]) == (2, 3, [3, 1])  # a packed pass's
    for row in (tree, packed):
        (against,), (working,) = row["against_in_steps"], row["working_in_steps"]
        assert against > 0 and working > 0 and row["difference"] == pytest.approx(working - against)
    module = benchmark("pass_ab")
    iteration = module.main(["--smoke", "--iteration", "--out", str(tmp_path), "--stem", "iteration"])
    assert iteration["timed"] == "greedy iteration (speculative_step)" and result["timed"] == "tree pass"
    assert all(r["working_in_steps"][0] > 0 for r in iteration["results"])
    for bad in ("1x", "0x2", "two", "1x0", "2x3:3", "2x3:2+2", "2x3:3+0", "2x3:3+x"):
        with pytest.raises(ValueError, match="--configs"):
            module.main(["--configs", bad, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--against 'no-such-revision'"):
        module.main(["--against", "no-such-revision", "--processes", "1", "--configs", "1x2", "--out", str(tmp_path)])


def test_speculation_ab_runs_each_side_once_unkept_before_its_rounds(tmp_path, monkeypatch):
    """Each side's library runs speculation.py once before the paired rounds, and that run's
    gains are not in the result: the revision's fresh export compiles, in its first process, the
    numba kernels of paths the benchmark's own warm-up calls do not reach, inside timed calls."""
    module = benchmark("speculation_ab")
    runs = []

    def fake(side, path, args, out, stem):
        runs.append((side, stem))
        gain = 0.5 if stem.endswith("_warm") else 1.2  # (a first run that compiled inside its timed calls)
        row = dict(mode="eager", batch=1, temperature=0.0, identical=True)
        return {"results": [dict(row, drafter="autoregressive", tokens_per_s=100.0, gain=1.0),
                            dict(row, drafter="ngram", tokens_per_s=100.0 * gain, gain=gain)]}
    monkeypatch.setattr(module, "_run", fake)
    result = module.main(["--processes", "2", "--out", str(tmp_path), "--stem", "warmed"])
    assert runs[:2] == [("against", "against_warm"), ("working", "working_warm")]
    assert sorted(runs[2:]) == [("against", "against_0"), ("against", "against_1"), ("working", "working_0"),
                                ("working", "working_1")]
    row = next(r for r in result["results"] if r["drafter"] == "ngram")
    assert row["against_gains"] == row["working_gains"] == [1.2, 1.2] and row["difference"] == 0.0


def test_speculation_ab_smoke_pairs_two_libraries_gains(tmp_path):
    """speculation.py once with each side's stree (checked by the script): both gains of every
    speculative configuration, their difference, every output identical; bad input is refused
    before any run."""
    result = smoke("speculation_ab", tmp_path)
    rows = result["results"]
    assert {r["drafter"] for r in rows} == {"autoregressive", "autoregressive again", "ngram", "ssm"}
    assert result["against"] == "HEAD"
    for r in rows:
        (against,), (working,) = r["against_tokens_per_s"], r["working_tokens_per_s"]
        assert against > 0 and working > 0 and r["speed_ratio"] == pytest.approx(working / against)
        if r["drafter"] == "autoregressive":  # (the gains' reference: no gain of its own)
            assert "against_gains" not in r and "difference" not in r
            continue
        (against,), (working,) = r["against_gains"], r["working_gains"]
        assert against > 0 and working > 0 and r["difference"] == pytest.approx(working - against)
        assert r["identical"] is True
    module = benchmark("speculation_ab")
    for bad in (["--processes", "0"], ["--", "--out", str(tmp_path)], ["--", "--stem=x"]):
        with pytest.raises(SystemExit) as exc:
            module.main([*bad])
        assert exc.value.code == 2
    with pytest.raises(ValueError, match="--against 'no-such-revision'"):
        module.main(["--against", "no-such-revision", "--out", str(tmp_path)])


@pytest.mark.skipif(not mamba_step.available(), reason="no C++ compiler for the CPU library here")
def test_pass_parts_smoke_times_each_part_of_a_greedy_iteration(tmp_path):
    """The timed build's parts are there (a build without the marks would read zeros) and within the call:
    a chain's head takes its whole chain at once, and a random draft's walk stops at the root."""
    result = smoke("pass_parts", tmp_path)
    assert torch.is_grad_enabled()  # (its measurement without autograd, the process's mode put back)
    assert set(result["rows"]) == {"chain 1", "binary 1", "chain 3", "binary 3"}
    for key, row in result["rows"].items():
        parts = row["parts_us"]
        assert set(parts) == {"in", "conv", "state", "scan", "out", "head", "walk", "replay", "laws"}
        assert all(parts[p] > 0 for p in ("in", "conv", "state", "scan", "out", "head", "replay")), key
        assert parts["laws"] >= 0 and sum(parts.values()) <= row["call_us"] and row["step_us"] > 0
        assert row["head_rows"] == int(key.split()[1])  # (a binary tree of 3: its chain of 2 topped up with the rest)


def test_pass_parts_refuses_bad_sizes():
    with pytest.raises(SystemExit) as e:
        benchmark("pass_parts").main(["--sizes", "2,x"])
    assert e.value.code == 2


def test_speculation_ab_gives_each_run_its_own_cost_profiles(tmp_path, monkeypatch):
    """Each run of speculation.py gets a cache directory of its own, without the shared cost profiles
    (each run measures its own, so the rounds sample a profile's error) and with the built libraries
    linked in (not built again)."""
    module = benchmark("speculation_ab")
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True)
    (shared / "costs.json").write_text("{}")
    monkeypatch.setenv("STREE_CACHE_DIR", str(shared))
    seen = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def fake_run(cmd, env, **kwargs):
        seen.append(env["STREE_CACHE_DIR"])
        done = Done()
        done.stdout = env["PYTHONPATH"].split(os.pathsep)[0] + "/stree/__init__.py"
        if "-c" not in cmd:
            out, stem = Path(cmd[cmd.index("--out") + 1]), cmd[cmd.index("--stem") + 1]
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{stem}.json").write_text('{"results": []}')
        return done
    monkeypatch.setattr(module.subprocess, "run", fake_run)
    for stem in ("working_0", "working_1"):
        assert module._run("working", str(tmp_path / "lib"), [], tmp_path / "out", stem) == {"results": []}
    own = {Path(d) for d in seen}
    assert len(own) == 2 and shared not in own
    for d in own:
        assert not (d / "costs.json").exists() and (d / "kernels").resolve() == (shared / "kernels").resolve()


@pytest.mark.skipif(not mamba_step.available(), reason="no C++ compiler for the CPU library here")
def test_library_ab_smoke_pairs_two_builds_of_the_one_call(tmp_path):
    """Both builds decode (two libraries, the same greedy text), each round timed; the other build's
    sources may be a revision's (the same sources: the same library); bad input is refused."""
    from stree.kernels.cpu import gemm

    module = benchmark("library_ab")
    result = smoke("library_ab", tmp_path, "--drop=-fno-trapping-math")
    assert [(r["method"], r["batch"]) for r in result["rows"]] == [("autoregressive", 1), ("ngram", 1)]
    for row in result["rows"]:
        assert row["identical"] and len(row["ratios"]) == result["rounds"] == 2
        assert min(row["working_tokens_per_s"] + row["other_tokens_per_s"]) > 0
    libs = module.libraries(["-fno-trapping-math"], None)
    assert libs["working"]._name != libs["other"]._name and libs["working"]._name == gemm.library()._name
    with pytest.raises(SystemExit, match="no-such-revision"):
        module.libraries([], "no-such-revision")  # (a clear exit too where git is missing)
    if shutil.which("git") and subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--",
                                               "stree/kernels/cpu"]).returncode == 0:
        same = module.libraries([], "HEAD")  # (the working tree's sources are HEAD's: one library)
        assert same["working"]._name == same["other"]._name == gemm.library()._name
    for bad in (["--drop", "-O9"], []):
        with pytest.raises(SystemExit) as e:
            module.main([*bad, "--out", str(tmp_path)])
        assert e.value.code == 2
