"""Local training text, split into train / held-out documents: a directory's files (default: the
standard library's Python sources found through ``sysconfig``, held out by a fixed module list), a
JSONL file (one document per record's ``text``) or a text file (documents separated by
``<|endoftext|>``), the last 5% of a file's documents held out; a byte-level BPE tokenizer trained
on the train split, and token batches of whole-document windows with a padding mask."""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Held out of training (tokenizer included): small, stable modules present in every CPython >= 3.10.
HELD_OUT = ("bisect.py", "calendar.py", "colorsys.py", "csv.py", "fractions.py", "getopt.py", "heapq.py",
            "json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py", "shlex.py",
            "statistics.py", "textwrap.py")
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
EOS = "<|endoftext|>"
HELD_OUT_SHARE = 0.05  # of a file corpus's documents (of one document's lines): the last ones


@dataclass(frozen=True)
class TextDoc:
    """A document that is no file of its own: a JSONL record, a piece of a text file."""

    name: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class SourceSplit:
    """Documents: files (``Path``) of a directory corpus, or :class:`TextDoc` of a file corpus."""

    root: Path
    train: list
    held_out: list

    def name(self, doc) -> str:
        """A document's name: its path relative to the corpus, or its file and record."""
        return doc.name if isinstance(doc, TextDoc) else doc.relative_to(self.root).as_posix()

    def fingerprint(self) -> str:
        """Hash of both splits' document names and bytes (records which corpus a run saw)."""
        h = hashlib.sha256()
        for part in (self.train, self.held_out):
            for doc in part:
                h.update(self.name(doc).encode() + b"\0" + (doc.text.encode() if isinstance(doc, TextDoc) else doc.read_bytes()))
        return h.hexdigest()[:16]


def find_sources(root: Path | str | None = None, held_out: tuple[str, ...] | None = None,
                 pattern: str = "*.py") -> SourceSplit:
    """The corpus at ``root``. A directory (default: the stdlib): every file matching ``pattern``
    under it outside test and site-packages directories, sorted; those whose path relative to
    ``root`` is in ``held_out`` (default :data:`HELD_OUT`) form the held-out split. A file: see
    :func:`file_documents`; its last :data:`HELD_OUT_SHARE` of documents are held out (of lines,
    when it holds one document). ValueError when either split is empty."""
    root = stdlib_root() if root is None else Path(root)
    if root.is_file():
        if held_out is not None:
            raise ValueError("held-out file names are for a directory corpus: a file corpus holds out its last "
                             f"{HELD_OUT_SHARE:.0%} of documents")
        return _split_file(root)
    if not root.is_dir():
        raise ValueError(f"corpus {root} does not exist (a directory, a .jsonl file or a text file)")
    held_out = HELD_OUT if held_out is None else held_out
    files = sorted(p for p in root.rglob(pattern)
                   if p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    names = set(held_out)
    test = [p for p in files if p.relative_to(root).as_posix() in names]
    train = [p for p in files if p.relative_to(root).as_posix() not in names]
    if not train or not test:
        raise ValueError(f"corpus {root}: {len(train)} training and {len(test)} held-out files "
                         f"(held-out list {sorted(names)}); both must be non-empty")
    return SourceSplit(root, train, test)


def file_documents(path: Path) -> list[TextDoc]:
    """The documents of a corpus file: a ``.jsonl`` file's records (each a JSON object with a string
    ``text``), or a text file cut at every ``<|endoftext|>``; empty ones dropped."""
    text = read_text(path)
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"corpus {path} line {i}: not JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"corpus {path} line {i}: expected an object with a string 'text' field")
            docs.append(TextDoc(f"{path.name}:{i}", record["text"]))
    else:
        docs = [TextDoc(f"{path.name}#{i}", piece) for i, piece in enumerate(text.split(EOS))]
    return [d for d in docs if d.text.strip()]


def _split_file(path: Path) -> SourceSplit:
    docs = file_documents(path)
    if len(docs) == 1:  # one document: its last lines are held out
        lines = docs[0].text.splitlines(keepends=True)
        if len(lines) < 2:
            raise ValueError(f"corpus {path} holds one line of text: nothing to hold out")
        cut = min(len(lines) - 1, max(1, math.floor(len(lines) * (1 - HELD_OUT_SHARE))))
        docs = [TextDoc(f"{docs[0].name}:train", "".join(lines[:cut])), TextDoc(f"{docs[0].name}:held-out",
                                                                                "".join(lines[cut:]))]
    if len(docs) < 2:
        raise ValueError(f"corpus {path} holds {len(docs)} non-empty documents: at least 2 needed")
    n_test = max(1, math.ceil(len(docs) * HELD_OUT_SHARE))
    return SourceSplit(path.parent, docs[:-n_test], docs[-n_test:])


def read_text(doc) -> str:
    """A document's text: a :class:`TextDoc`'s, or a file's (UTF-8, bad bytes replaced)."""
    if isinstance(doc, TextDoc):
        return doc.text
    return doc.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int, max_bytes: int | None = None):
    """A byte-level BPE (``tokenizers``) trained on ``files`` (the first ``max_bytes`` of them in
    order), wrapped as a transformers fast tokenizer with EOS = PAD = ``<|endoftext|>`` (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts, total = [], 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        texts.append(read_text(path))
        total += len(texts[-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


class TokenCorpus:
    """Documents as token arrays. Training windows start anywhere in a document and end at its
    end at the latest; the positions past the end are padding (masked out of every loss)."""

    def __init__(self, docs: list[np.ndarray], pad_id: int, n_bytes: int):
        docs = [d for d in docs if len(d) >= 2]
        if not docs:
            raise ValueError("the corpus holds no document of two or more tokens")
        self.docs, self.pad_id, self.n_bytes = docs, pad_id, n_bytes
        self.lengths = np.array([len(d) for d in docs])
        self.n_tokens = int(self.lengths.sum())

    @classmethod
    def encode(cls, tokenizer, files: list[Path]) -> "TokenCorpus":
        texts = [read_text(p) for p in files]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return cls([np.asarray(x, dtype=np.int32) for x in ids], tokenizer.pad_token_id,
                   sum(len(t.encode("utf-8")) for t in texts))

    def _window(self, doc: np.ndarray, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        piece = doc[start:start + length]
        ids = np.full(length, self.pad_id, dtype=np.int64)
        ids[:len(piece)] = piece
        return ids, np.arange(length) < len(piece)

    def sample(self, batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` windows of ``length`` tokens: ids ``[batch, length]`` and the real-token mask.
        Start positions are uniform over the corpus's tokens (a document's last token excluded)."""
        starts = torch.randint(0, self.n_tokens - len(self.docs), (batch,), generator=generator).numpy()
        room = np.cumsum(self.lengths - 1)
        which = np.searchsorted(room, starts, side="right")
        offsets = starts - np.concatenate([[0], room])[which]
        pieces = [self._window(self.docs[d], int(o), length) for d, o in zip(which, offsets)]
        return torch.from_numpy(np.stack([p[0] for p in pieces])), torch.from_numpy(np.stack([p[1] for p in pieces]))

    def windows(self, length: int, max_tokens: int | None = None):
        """Consecutive windows of ``length`` tokens covering each document from its start (each
        window begins a fresh context), in order, until ``max_tokens`` tokens are covered; yields
        (ids, mask) of shape ``[length]``."""
        covered = 0
        for doc in self.docs:
            for start in range(0, len(doc), length):
                if max_tokens is not None and covered >= max_tokens:
                    return
                ids, mask = self._window(doc, start, length)
                covered += int(mask.sum())
                yield ids, mask

    def window_batches(self, length: int, max_tokens: int | None, batch: int, device):
        """:meth:`windows` stacked ``batch`` at a time: (ids, mask) tensors ``[<= batch, length]``."""
        windows = list(self.windows(length, max_tokens))
        for i in range(0, len(windows), batch):
            chunk = windows[i:i + batch]
            yield (torch.from_numpy(np.stack([w[0] for w in chunk])).to(device),
                   torch.from_numpy(np.stack([w[1] for w in chunk])).to(device))

    def bytes_per_token(self) -> float:
        return self.n_bytes / self.n_tokens

    def unigram_counts(self, vocab_size: int) -> np.ndarray:
        return np.bincount(np.concatenate(self.docs), minlength=vocab_size)[:vocab_size]


def code_prompts(files: list[Path], per_file: int = 2, context_lines: int = 12) -> list[str]:
    """Completion prompts: up to ``context_lines`` lines before a ``def`` line, that line and the
    indentation of the body's first line; the first ``per_file`` functions with a body of 3+
    lines in each file."""
    prompts = []
    for path in files:
        lines, taken = read_text(path).splitlines(), 0
        for i, line in enumerate(lines[:-3]):
            body = lines[i + 1]
            if taken < per_file and line.lstrip().startswith("def ") and line.rstrip().endswith(":") and body.strip():
                indent = body[:len(body) - len(body.lstrip())]
                prompts.append("\n".join(lines[max(0, i - context_lines):i + 1]) + "\n" + indent)
                taken += 1
    return prompts
