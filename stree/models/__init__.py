"""Target models implementing the tree-decoding protocol (see ARCHITECTURE.md)."""

from .cache import Mamba2Cache, SSMScratch
from .config import Mamba2Config
from .loading import detect_format, load, load_tokenizer, save
from .mamba2 import Mamba2LM

__all__ = ["Mamba2Cache", "Mamba2Config", "Mamba2LM", "SSMScratch", "detect_format", "load", "load_tokenizer", "save"]
