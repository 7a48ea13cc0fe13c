"""Drafters: propose token trees from token ids alone (see :class:`Drafter`)."""

from .base import DraftContext, Drafter
from .ngram import NGramDrafter

__all__ = ["DraftContext", "Drafter", "NGramDrafter"]
