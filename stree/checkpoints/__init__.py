"""Checkpoints: reading and writing model directories (mamba_ssm, transformers, MambaInLlama), Hub ids, the tokenizer."""
