"""Target models implementing the tree-decoding protocol (see ARCHITECTURE.md)."""

from .cache import Mamba2Cache, SSMScratch
from .config import Mamba2Config
from .mamba2 import Mamba2LM

__all__ = ["Mamba2Cache", "Mamba2Config", "Mamba2LM", "SSMScratch"]
