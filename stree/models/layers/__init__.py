"""The layers the families are built from: the Mamba2 mixer, attention, MLPs and mixtures of
experts, norms, and the CPU-aware linear product. Each token mixer has one interface (``tree``,
``step``, ``stack_scratch``, ``commit_layers``: :mod:`stree.models.base`)."""
