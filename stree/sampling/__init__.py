"""Lossless verification of a token tree against the target's logits, and its numba-compiled CPU walk."""
