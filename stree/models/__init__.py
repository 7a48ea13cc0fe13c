"""Target models implementing the tree-decoding protocol (docs/architecture.md, docs/models.md)."""

from .cache import AttnScratch, ModelCache, SSMScratch, TreePass
from .config import HybridConfig, Mamba2Config
from .families.bamba import BambaConfig, BambaLM
from .families.falcon_h1 import FalconH1Config, FalconH1LM
from .families.granite import GraniteConfig, GraniteLM
from .families.llama import LlamaLM, Qwen2LM, TransformerConfig
from .families.mamba2 import Mamba2LM
from .families.mambainllama import HybridLM
from .families.nemotron_h import NemotronHConfig, NemotronHLM
from .layers.attention import AttentionConfig
from .parallel import TensorParallel, join, leave

# Loading and saving live in stree.checkpoints (which builds these models); their public names are
# kept here too, resolved on first use so that importing a model never imports the loaders.
CHECKPOINT_NAMES = {"DTYPES": "io", "detect_format": "formats", "from_transformers": "io", "load": "io",
                    "load_tokenizer": "tokenizer", "save": "io", "shard": "io"}


def __getattr__(name):
    if name in CHECKPOINT_NAMES:
        import importlib

        return getattr(importlib.import_module(f"..checkpoints.{CHECKPOINT_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'stree.models' has no attribute {name!r}")


__all__ = ["DTYPES", "AttentionConfig", "BambaConfig", "BambaLM", "NemotronHConfig", "NemotronHLM", "GraniteConfig", "GraniteLM", "FalconH1Config", "FalconH1LM", "AttnScratch", "HybridConfig", "HybridLM", "LlamaLM", "Qwen2LM", "TransformerConfig", "ModelCache", "Mamba2Config", "Mamba2LM", "SSMScratch", "TreePass", "detect_format", "from_transformers", "load", "load_tokenizer", "save", "shard", "TensorParallel", "join", "leave"]
