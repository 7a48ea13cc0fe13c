"""The shipped tiny target + drafter pair and `stree demo` end to end."""

import json

import pytest

import stree.tools.demo as demo
from stree.tools.cli import main as cli_main


def test_shipped_pair_is_small_trained_and_loadable():
    files = [f for d in (demo.TARGET, demo.DRAFTER) for f in d.iterdir()]
    assert {f.name for f in files} >= {"config.json", "model.safetensors", "tokenizer.json", "prompts.jsonl",
                                       "training.json", "distill.json", "draft_vocab.json"}
    assert sum(f.stat().st_size for f in files) <= 10.5e6
    trained = json.loads((demo.TARGET / "training.json").read_text())
    assert trained["model_bits_per_byte"] < 0.7 * trained["unigram_bits_per_byte"]
    distilled = json.loads((demo.DRAFTER / "distill.json").read_text())
    assert distilled["held_out_top1_agreement"] > distilled["at_init"]["held_out_top1_agreement"] + 0.1


def test_demo_decodes_every_method_identically(capsys):
    rows = demo.run_demo(prompts=1, max_new_tokens=12)
    assert [(r["method"], r["drafter"]) for r in rows[:-1]] == [(m, d or "-") for m, d in demo.RUNS[:-1]]
    assert (rows[-1]["method"], rows[-1]["drafter"]) == ("autoregressive", "again")  # the noise row
    assert all(r["identical"] and r["tokens"] == 12 for r in rows)
    assert rows[0]["tau"] == 1.0 and all(r["tau"] >= 1.0 for r in rows)
    assert all(sum(r["trees"].values()) > 0 for r in rows) and set(rows[0]["trees"]) == set(rows[-1]["trees"]) == {1}
    out = capsys.readouterr().out
    assert "identical" in out and out.count(" yes ") == len(rows) and "warm-up" in out and "plain" in out
    assert "run-to-run noise" in out


def test_demo_gives_every_call_a_drafter_of_its_own_as_the_text_api_does(monkeypatch):
    """As ``LM.generate`` makes a named drafter for each call (STAND a fresh store sized for the call,
    ``serves_one_call``), so does the demo: a store shared over its unrelated prompts had drafted earlier
    prompts' continuations."""
    real, seen = demo.generate, []

    def spy(*args, **kw):
        if kw.get("drafter") is not None:
            seen.append(kw["drafter"])
        return real(*args, **kw)

    monkeypatch.setattr(demo, "generate", spy)
    demo.run_demo(prompts=2, max_new_tokens=4, out=lambda *a: None)
    speculative = sum(name is not None for _, name in demo.RUNS)
    assert len(seen) == speculative * 3  # (a warm-up call and a call per prompt, each run)
    assert len({id(d) for d in seen}) == len(seen) and all(d.serves_one_call for d in seen)
    stand = [d for d in seen if type(d).__name__ == "STANDDrafter"]
    assert stand and len({id(d.store) for d in stand}) == len(stand)


def test_demo_reports_a_difference_and_exits_1(monkeypatch, capsys):
    real = demo.generate

    def wrong_chain(*args, **kw):
        out = real(*args, **kw)
        if kw["method"] == "chain":
            out.sequences[0][-1] = (out.sequences[0][-1] + 1) % 100
        return out

    monkeypatch.setattr(demo, "generate", wrong_chain)
    assert cli_main(["demo", "--prompts", "1", "--max-new-tokens", "4"]) == 1
    captured = capsys.readouterr()
    assert " NO" in captured.out and "differ" in captured.err


def test_cli_demo_runs(capsys):
    assert cli_main(["demo", "--prompts", "1", "--max-new-tokens", "4"]) == 0
    assert "held-out prompts" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["demo", "--help"])
