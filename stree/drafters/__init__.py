"""Drafters: propose token trees from token ids alone (see :class:`Drafter`)."""

from .base import DraftContext, Drafter, TargetTop
from .consensus import ConsensusDAG, ConsensusDrafter, PathStore
from .ngram import NGramDrafter
from .per_row import PerRowDrafter
from .ssm import SSMDrafter
from .stand import STANDDrafter, STANDStore, gumbel_top_k

__all__ = ["ConsensusDAG", "ConsensusDrafter", "DraftContext", "Drafter", "NGramDrafter", "PathStore", "PerRowDrafter", "SSMDrafter",
           "STANDDrafter", "STANDStore", "TargetTop", "gumbel_top_k"]
