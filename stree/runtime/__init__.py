"""How a model's calls run: eager, from CUDA graphs, compiled with torch.compile, or unrolled (the
paper's baseline), behind the runners the decoding loop drives."""

from .compiled import CompiledDecode, CompiledModel
from .graphs import DecodeGraphs, GraphedCommit, GraphedIteration, GraphedStep, GraphedTreePass
from .runners import DecodeRunner

__all__ = ["CompiledDecode", "CompiledModel", "DecodeGraphs", "DecodeRunner", "GraphedCommit", "GraphedIteration",
           "GraphedStep", "GraphedTreePass"]
