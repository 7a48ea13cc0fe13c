"""The tokenizer a checkpoint directory (or a Hub id) holds, loaded offline."""

from __future__ import annotations

from .hub import resolve


def load_tokenizer(path, vocab_size: int | None = None, revision: str | None = None):
    """The tokenizer saved in checkpoint directory ``path`` (or of that Hub id, as :func:`load`),
    loaded offline. With ``vocab_size`` (the model's), a tokenizer that can produce ids the model
    has no row for is a ValueError."""
    from transformers import AutoTokenizer

    path = resolve(path, revision)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"{path} holds no tokenizer (tokenizer.json / tokenizer_config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer in {path} has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}")
    return tokenizer
