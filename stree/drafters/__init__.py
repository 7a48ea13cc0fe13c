"""Drafters: propose token trees from token ids alone (see :class:`Drafter`)."""

from .base import DraftContext, Drafter
from .ngram import NGramDrafter
from .stand import STANDDrafter, STANDStore, gumbel_top_k

__all__ = ["DraftContext", "Drafter", "NGramDrafter", "STANDDrafter", "STANDStore", "gumbel_top_k"]
