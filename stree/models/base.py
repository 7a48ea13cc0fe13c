"""What every target model shares: input checks, chunked prefill through the tree path, the
training forward, and the checks around the single-token step."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import MAX_TREE_NODES, check_accepted
from ..tree import TokenTree, TreeShape
from .cache import ModelCache

TREE_BACKENDS = ("tree", "chain", "unrolled")


class TreeLM(nn.Module):
    """Subclasses implement ``allocate_cache``, ``tree_pass`` (the layers over a validated tree,
    storing each layer's scratch in the cache), ``step_pass`` (one token per row, states advanced
    in place, ``seqlens`` left to the caller) and ``commit``."""

    kernel_backend = "auto"  # "triton" forces the Triton kernels (tests: under the interpreter)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def check_tokens(self, name, tokens, values: bool = True):
        """dtype and device; with ``values`` also the vocabulary range (a device-to-host sync)."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.device != self.device:
            raise ValueError(f"{name} is on {tokens.device} but the model is on {self.device}")
        if not values:
            return
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bool(bad.any()):
            pos = tuple(int(v) for v in torch.nonzero(bad)[0])
            raise ValueError(f"{name}{list(pos)} = {int(tokens[pos])} is outside the vocabulary [0, {self.vocab_size})")

    def check_cache(self, cache: ModelCache, batch: int, new_tokens: int, lengths: bool = True):
        """Batch size; with ``lengths`` also the room left (a device-to-host sync)."""
        if cache.batch_size != batch:
            raise ValueError(f"the cache holds {cache.batch_size} rows but the input has batch {batch}")
        if not lengths:
            return
        longest = int(cache.seqlens.max()) + new_tokens
        if longest > cache.max_length:
            raise ValueError(f"sequence would reach {longest} tokens, past the cache's max_length {cache.max_length}")

    def check_tree(self, tree: TokenTree, cache: ModelCache, backend: str):
        if backend not in TREE_BACKENDS:
            raise ValueError(f"backend must be one of {TREE_BACKENDS}, got {backend!r}")
        self.check_tokens("tree.tokens", tree.tokens)
        index = tree.index
        self.check_cache(cache, tree.batch_size, int(index.depth.max()) + 1)
        if backend == "chain" and not bool((index.depth == torch.arange(tree.n, device=index.device)).all()):
            raise ValueError("backend='chain' needs a chain tree (parents[i] == i - 1)")
        return index

    def check_commit(self, cache: ModelCache, tree: TokenTree, accepted, num_accepted):
        """Once per commit, so the per-layer kernels can skip their own index checks."""
        if cache.tree_n != tree.n or any(s is None for s in cache.scratch):
            raise ValueError("commit needs the forward_tree pass of this same tree just before it")
        check_accepted(accepted, num_accepted, tree.n)

    def finish_commit(self, cache: ModelCache, num_accepted: torch.Tensor):
        cache.seqlens += num_accepted.to(cache.seqlens.device)
        cache.drop_scratch()

    @torch.no_grad()
    def forward_tree(self, tree: TokenTree, cache: ModelCache, backend: str = "tree") -> torch.Tensor:
        """Logits ``[b, n, V]`` at every tree node; the committed state is not changed.
        ``backend`` ("tree", "chain", "unrolled") chooses the SSM layers' algorithm."""
        index = self.check_tree(tree, cache, backend)
        return self.tree_pass(tree, index, cache, backend, self.kernel_backend)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Differentiable logits ``[b, T, V]`` at every position of ``input_ids [b, T]`` from an
        empty state (training): one chain through the PyTorch reference kernels, since the Triton
        kernels have no backward."""
        self.check_tokens("input_ids", input_ids)
        if input_ids.dim() != 2 or not 1 <= input_ids.shape[1] <= MAX_TREE_NODES:
            raise ValueError(f"input_ids must be [batch, T] with 1 <= T <= {MAX_TREE_NODES}, got {tuple(input_ids.shape)}")
        batch, T = input_ids.shape
        tree = TokenTree.from_shape(TreeShape.chain(T - 1), input_ids)
        return self.tree_pass(tree, tree.index, self.allocate_cache(batch, T), "tree", "torch")

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: ModelCache, validate: bool = True) -> torch.Tensor:
        """Feed one token per row (``[b]``); returns next-token logits ``[b, V]``. The fast path:
        no tree, no scratch, each layer's state advanced in place by one token.

        ``validate=False`` skips the vocabulary-range and cache-room checks, the only
        device-to-host syncs of a step, so that it can be captured in a CUDA graph; the caller
        then answers for both (see :class:`stree.models.graphs.GraphedStep`)."""
        self.check_tokens("tokens", tokens, values=validate)
        if tokens.dim() != 1:
            raise ValueError(f"tokens must have shape [batch], got {tuple(tokens.shape)}")
        self.check_cache(cache, tokens.shape[0], 1, lengths=validate)
        logits = self.step_pass(tokens, cache)
        cache.seqlens += 1
        cache.drop_scratch()
        return logits

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: ModelCache, lengths: torch.Tensor | None = None,
                chunk: int = MAX_TREE_NODES) -> torch.Tensor:
        """Feed right-padded prompts ``[b, T]`` (row b's first ``lengths[b] >= 1`` tokens) as chains
        of at most ``chunk`` tokens; returns the logits after each row's last token ``[b, V]``."""
        self.check_tokens("input_ids", input_ids)
        batch, T = input_ids.shape
        lengths = torch.full((batch,), T) if lengths is None else lengths.cpu()
        if tuple(lengths.shape) != (batch,) or bool(((lengths < 1) | (lengths > T)).any()):
            raise ValueError(f"lengths must be [batch] with 1 <= lengths <= {T}, got {lengths.tolist()}")
        if not 1 <= chunk <= MAX_TREE_NODES:
            raise ValueError(f"chunk must be in [1, {MAX_TREE_NODES}], got {chunk}")
        self.check_cache(cache, batch, int(lengths.max()))
        last = torch.empty(batch, self.vocab_size, device=self.device, dtype=self.dtype)
        for start in range(0, T, chunk):
            end = min(T, start + chunk)
            counts = (lengths - start).clamp(0, end - start)
            rows = torch.nonzero(counts > 0).flatten().to(self.device)
            sub = cache if len(rows) == batch else cache.select(rows)
            tree = TokenTree.from_shape(TreeShape.chain(end - start - 1), input_ids[rows, start:end])
            logits = self.forward_tree(tree, sub)
            n = counts[counts > 0].to(self.device)
            self.commit(sub, tree, torch.arange(end - start, device=self.device).expand(len(rows), -1), n)
            if sub is not cache:
                cache.assign(rows, sub)
            pick = torch.nonzero((lengths[counts > 0] <= end).to(self.device)).flatten()
            last[rows[pick]] = logits[pick, n[pick] - 1]
        return last
