"""Local training text: Python source files (default: the standard library found through
``sysconfig``) split into train / held-out by a fixed module list, a byte-level BPE tokenizer
trained on the train split, and token batches of whole-document windows with a padding mask."""

from __future__ import annotations

import hashlib
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


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass
class SourceSplit:
    root: Path
    train: list[Path]
    held_out: list[Path]

    def fingerprint(self) -> str:
        """Hash of both splits' relative paths and bytes (records which corpus a run saw)."""
        h = hashlib.sha256()
        for part in (self.train, self.held_out):
            for path in part:
                h.update(str(path.relative_to(self.root)).encode() + b"\0" + path.read_bytes())
        return h.hexdigest()[:16]


def find_sources(root: Path | str | None = None, held_out: tuple[str, ...] = HELD_OUT) -> SourceSplit:
    """Every ``*.py`` under ``root`` (default: the stdlib) outside test and site-packages
    directories, sorted; files whose path relative to ``root`` is in ``held_out`` form the held-out
    split. ValueError when either split is empty."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"corpus directory {root} does not exist")
    files = sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    names = set(held_out)
    test = [p for p in files if p.relative_to(root).as_posix() in names]
    train = [p for p in files if p.relative_to(root).as_posix() not in names]
    if not train or not test:
        raise ValueError(f"corpus {root}: {len(train)} training and {len(test)} held-out files "
                         f"(held-out list {sorted(names)}); both must be non-empty")
    return SourceSplit(root, train, test)


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


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
