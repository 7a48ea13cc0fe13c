"""Stop strings on text read incrementally (:class:`stree.decoding.stops.TextStops`): after every
update the text equals the tokenizer's decoding of the whole row, for the tokenizer families
models ship (byte-level BPE, SentencePiece-style with byte fallback, WordPiece with clean-up of
spaces), and a stop string cuts where decoding the row whole finds it; a step's decoding does not
grow with the row."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.checkpoints.tokenizer import load_tokenizer
from stree.decoding.stops import TextStops
from stree.tools.demo import TARGET

CORPUS = [json.loads(line)["prompt"] for line in (Path(TARGET) / "prompts.jsonl").read_text().splitlines()] + [
    "héllo wörld, ça coûte 5 € — naïve 日本語のテキスト 😀 emoji, don't stop ; it's here .",
    "x = [1, 2, 3] ; print ( x ) # end", "über straße ñ 中文 🚀🚀 the end .\n\n",
]


@functools.lru_cache(maxsize=None)
def tokenizer(family: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family == "byte-level":
        return load_tokenizer(TARGET)
    if family == "sentencepiece":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=special))
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


FAMILIES = ["byte-level", "sentencepiece", "wordpiece"]


def full(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def rows(draw_ids):
    """A row's tokens (from the tokenizer's whole vocabulary, special tokens and the bytes of
    partial characters included, or real text) and the sizes of the steps that grow it."""
    return st.tuples(draw_ids, st.lists(st.integers(1, 6), min_size=1, max_size=200), st.booleans())


def grow(tok, ids, steps, tracker):
    """Feed ``ids`` step by step; after each update, the text must be the whole row's."""
    n = 0
    for size in steps:
        if n >= len(ids):
            break
        n = min(len(ids), n + size)
        keep = tracker.update(ids[:n])
        if keep is not None:
            return keep
        assert tracker.text == full(tok, ids[:n]), (n, tracker.text, full(tok, ids[:n]))
    return None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("context,span", [(TextStops.CONTEXT, TextStops.SPAN), (1, 2)])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_text_read_step_by_step_is_the_whole_rows_decoding(family, context, span, data):
    tok = tokenizer(family)
    real = st.sampled_from(CORPUS).map(lambda text: tok(text * 3, add_special_tokens=False)["input_ids"])
    noise = st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=300)
    ids, steps, _ = data.draw(rows(st.one_of(real, noise)))
    tracker = TextStops(tok, [])
    tracker.CONTEXT, tracker.SPAN = context, span
    assert grow(tok, ids, steps, tracker) is None


def reference(tok, ids, steps, stops):
    """What decoding the whole row at every step finds: (tokens kept, text) at the first step whose
    text holds a stop string, else None."""
    n = seen = 0
    for size in steps:
        if n >= len(ids):
            break
        n = min(len(ids), n + size)
        text = full(tok, ids[:n])
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            start, stop = min(hits)
            keep = next(k for k in range(seen + 1, n + 1) if stop in full(tok, ids[:k]))
            return keep, text[:start]
        seen = n
    return None


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_stop_string_cuts_where_the_whole_rows_text_shows_it(family, data):
    tok = tokenizer(family)
    text = data.draw(st.sampled_from(CORPUS)) * 4
    ids = tok(text, add_special_tokens=False)["input_ids"]
    steps = data.draw(st.lists(st.integers(1, 6), min_size=len(ids), max_size=len(ids)))
    whole = full(tok, ids)
    at = data.draw(st.integers(0, len(whole) - 1))
    stops = [whole[at: at + data.draw(st.integers(1, 6))], "never in the text"]
    tracker = TextStops(tok, stops)
    tracker.CONTEXT, tracker.SPAN = 1, data.draw(st.integers(1, 8))
    keep = grow(tok, ids, steps, tracker)
    assert (keep, tracker.text) == reference(tok, ids, steps, stops)
    assert tracker.cut == len(tracker.text) and tracker.stop in stops


class Rewriting:
    """A tokenizer whose text a later token can change before it: each id is a letter, and "abb" in
    the joined text reads "X" (a rule across tokens, as a decoder's clean-up may have, reaching
    back no further than the window's first token)."""

    def decode(self, ids, **kwargs):
        return "".join("ab"[i] for i in ids).replace("abb", "X")


def test_a_later_token_that_changes_settled_text_is_read_whole():
    tok = Rewriting()
    for seed in range(40):
        rng = random.Random(seed)
        ids = [rng.randint(0, 1) for _ in range(60)]
        steps = [rng.randint(1, 4) for _ in range(60)]
        tracker = TextStops(tok, [])
        tracker.CONTEXT, tracker.SPAN = 1, rng.randint(1, 6)
        assert grow(tok, ids, steps, tracker) is None
        assert tracker.text == full(tok, ids)


class Counting:
    """A tokenizer that counts the tokens each decode reads."""

    def __init__(self, tok):
        self.tok, self.read = tok, []

    def decode(self, ids, **kwargs):
        self.read.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_a_steps_decoding_does_not_grow_with_the_row():
    tok = Counting(tokenizer("byte-level"))
    ids = tok.tok(" ".join(CORPUS) * 20, add_special_tokens=False)["input_ids"][:3000]
    assert len(ids) == 3000
    tracker = TextStops(tok, ["never in the text"])
    per_step = []
    for n in range(3, len(ids) + 1, 3):
        tok.read.clear()
        assert tracker.update(ids[:n]) is None
        per_step.append(sum(tok.read))
    assert tracker.text == full(tok.tok, ids)
    # each step decodes the window past the mark, and once in SPAN steps the mark's own: never the row whole
    bound = 3 * (TextStops.CONTEXT + TextStops.SPAN + 3)
    assert max(per_step[100:]) <= bound, max(per_step[100:])
    assert sum(per_step) <= len(per_step) * (TextStops.CONTEXT + TextStops.SPAN)
