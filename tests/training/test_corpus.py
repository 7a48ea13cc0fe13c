"""Training corpora beyond a directory of .py files: JSONL records, text files cut at
<|endoftext|>, one long document, other file patterns; held-out splits; errors naming the line."""

import json

import pytest

from stree.tools.cli import main as cli_main
from stree.training import LoopConfig, distill
from stree.training.corpus import EOS, TextDoc, find_sources, read_text
from test_distill import SIZE, corpus, target  # noqa: F401 - fixtures
from test_train_lm import make_corpus


def test_a_jsonl_corpus_holds_out_its_last_documents(tmp_path):
    path = tmp_path / "gen.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}\n"}) + "\n" for i in range(41)) + "\n")
    split = find_sources(path)
    assert [read_text(d) for d in split.train] == [f"doc {i}\n" for i in range(38)]  # ceil(5% of 41) = 3 held out
    assert [split.name(d) for d in split.held_out] == ["gen.jsonl:39", "gen.jsonl:40", "gen.jsonl:41"]
    assert split.fingerprint() == find_sources(path).fingerprint()
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(ValueError, match="gen.jsonl line 2: expected an object with a string 'text' field"):
        find_sources(path)
    path.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="gen.jsonl line 2: not JSON"):
        find_sources(path)


def test_a_text_file_is_cut_at_the_end_of_text_marker_or_by_lines(tmp_path):
    path = tmp_path / "books.txt"
    path.write_text(f"first\n{EOS}second\n{EOS}\n{EOS}third\n")
    split = find_sources(path)
    assert [d.text for d in split.train] == ["first\n", "second\n"] and [d.text for d in split.held_out] == ["third\n"]
    path.write_text("".join(f"line {i}\n" for i in range(40)))
    split = find_sources(path)
    assert split.train[0].text + split.held_out[0].text == path.read_text()
    assert split.held_out[0].text == "line 38\nline 39\n"  # the last 5% of its lines
    path.write_text("one line")
    with pytest.raises(ValueError, match="holds one line of text"):
        find_sources(path)
    with pytest.raises(ValueError, match="held-out file names are for a directory corpus"):
        find_sources(path, ("x.py",))
    with pytest.raises(ValueError, match="does not exist"):
        find_sources(tmp_path / "nothing")


def test_a_directory_corpus_takes_a_file_pattern(tmp_path):
    for i in range(3):
        (tmp_path / f"n{i}.md").write_text(f"# note {i}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    split = find_sources(tmp_path, ("n2.md",), "*.md")
    assert [split.name(d) for d in split.train] == ["n0.md", "n1.md"] and split.held_out == [tmp_path / "n2.md"]
    assert not isinstance(split.train[0], TextDoc)


def test_distill_on_the_targets_own_text_as_jsonl(corpus, target, tmp_path, capsys):  # noqa: F811
    """The papers' setting: the drafter learns from the target's own generations, given as JSONL."""
    from stree.lm import LM

    lm = LM.from_pretrained(target)
    texts = lm.generate(["def ", "class ", "import "], max_new_tokens=40, temperature=1.0, seed=0).texts
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps({"text": p + t}) + "\n" for p, t in zip(["def ", "class ", "import "], texts)))
    loop = LoopConfig(steps=4, batch_size=2, seq_len=16, lr=3e-3, warmup=1, seed=0, save_every=10)
    report = distill(target, tmp_path / "d", corpus=path, loop=loop, eval_tokens=50, progress=False)
    assert report["held_out_positions"] > 0
    args = ["distill", "--target", str(target), "--out", str(tmp_path / "e"), "--corpus", str(path), "--held-out", "x.py"]
    assert cli_main(args) == 2
    assert "held-out file names are for a directory corpus" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()  # refused before anything was written
