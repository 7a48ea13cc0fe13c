"""stree: speculative tree decoding for Mamba2 and hybrid SSM/attention language models."""

from .tree import TokenTree, TreeIndex, TreeShape, ancestor_mask, check_parents, tree_index

__version__ = "0.1.0"

__all__ = ["TokenTree", "TreeIndex", "TreeShape", "ancestor_mask", "check_parents", "tree_index", "__version__"]
