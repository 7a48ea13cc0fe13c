"""stree: speculative tree decoding for Mamba2 and hybrid SSM/attention language models."""

from .tree import TokenTree, TreeIndex, TreeShape, ancestor_mask, check_parents, tree_index

__version__ = "0.1.0"



def __getattr__(name):  # stree.LM, stree.generate, stree.decode without importing the models at ``import stree``
    if name == "LM":
        from .lm import LM

        return LM
    if name in ("generate", "decode"):
        from .decoding import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'stree' has no attribute {name!r}")


__all__ = ["LM", "generate", "decode", "TokenTree", "TreeIndex", "TreeShape", "ancestor_mask", "check_parents", "tree_index", "__version__"]
