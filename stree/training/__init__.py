"""Training small models on local text: ``train_lm`` (a target from scratch) and ``distill``
(a small Mamba2 drafter from a target's logits)."""

from .corpus import HELD_OUT, TokenCorpus, code_prompts, find_sources, train_tokenizer
from .distill import distill
from .loop import LoopConfig
from .train_lm import ModelSize, train_lm

__all__ = ["HELD_OUT", "LoopConfig", "distill", "ModelSize", "TokenCorpus", "code_prompts", "find_sources", "train_lm",
           "train_tokenizer"]
