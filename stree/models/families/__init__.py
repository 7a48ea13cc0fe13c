"""The model families: each a config (read from and written to its checkpoint formats by
:mod:`stree.checkpoints.formats`) and its block list over :class:`stree.models.base.TreeLM`."""
