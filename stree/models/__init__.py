"""Target models implementing the tree-decoding protocol (see ARCHITECTURE.md)."""

from .cache import AttnScratch, ModelCache, SSMScratch, TreePass
from .attention import AttentionConfig
from .bamba import BambaConfig, BambaLM
from .config import HybridConfig, Mamba2Config
from .compiled import CompiledDecode, CompiledModel
from .graphs import DecodeGraphs, GraphedCommit, GraphedStep, GraphedTreePass
from .runners import DecodeRunner
from .hybrid import HybridLM
from .loading import DTYPES, detect_format, from_transformers, load, load_tokenizer, save, shard
from .llama import LlamaLM, Qwen2LM, TransformerConfig
from .mamba2 import Mamba2LM
from .falcon_h1 import FalconH1Config, FalconH1LM
from .granite import GraniteConfig, GraniteLM
from .nemotron_h import NemotronHConfig, NemotronHLM
from .parallel import TensorParallel, join, leave

__all__ = ["DTYPES", "AttentionConfig", "BambaConfig", "BambaLM", "NemotronHConfig", "NemotronHLM", "GraniteConfig", "GraniteLM", "FalconH1Config", "FalconH1LM", "AttnScratch", "CompiledDecode", "CompiledModel", "DecodeGraphs", "DecodeRunner", "GraphedCommit", "GraphedStep", "GraphedTreePass", "HybridConfig", "HybridLM", "LlamaLM", "Qwen2LM", "TransformerConfig", "ModelCache", "Mamba2Config", "Mamba2LM", "SSMScratch", "TreePass", "detect_format", "from_transformers", "load", "load_tokenizer", "save", "shard", "TensorParallel", "join", "leave"]
