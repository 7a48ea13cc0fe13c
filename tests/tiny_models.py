"""Tiny random models of both families, shared by the protocol and end-to-end decoding tests."""

import torch

from stree.models import HybridLM, Mamba2LM
from stree.models.presets import tiny_hybrid, tiny_mamba2

VOCAB = 90


def perturb_norms(model):
    with torch.no_grad():  # non-trivial norm weights, so every term matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("norm_f.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def mamba2(vocab_size=VOCAB, seed=0, **kw):
    torch.manual_seed(seed)
    return perturb_norms(Mamba2LM(tiny_mamba2(vocab_size=vocab_size, **kw)).eval())


def hybrid(vocab_size=VOCAB, seed=0, **kw):
    torch.manual_seed(seed)
    return perturb_norms(HybridLM(tiny_hybrid(vocab_size=vocab_size, **kw)).eval())


FAMILIES = {"mamba2": mamba2, "hybrid": hybrid}


def count_calls(monkeypatch, owner, name: str) -> list:
    """A one-item list counting the calls of ``owner.name`` (a method, still called) from now on."""
    seen = [0]
    real = getattr(owner, name)

    def counted(*a, **k):
        seen[0] += 1
        return real(*a, **k)
    monkeypatch.setattr(owner, name, counted)
    return seen


def with_biases(model):
    """``model`` with its biases and D made non-trivial (every parameter matters)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", ".D")):
                p.add_(0.2 * torch.randn_like(p, generator=torch.Generator().manual_seed(len(name))))
    return model


def layer_by_layer(monkeypatch):
    """A Mamba2 model's steps, prefills, draft passes, greedy iterations and greedy drafts as its
    blocks' own calls, not one call each (stree.models.fused_step): for tests of those calls, and of the compiled
    graphs of them."""
    monkeypatch.setattr(Mamba2LM, "fused_step", lambda self, *a: None)
    monkeypatch.setattr(Mamba2LM, "fused_prefill", lambda self, *a: None)
    monkeypatch.setattr(Mamba2LM, "fused_tree", lambda self, *a: None)
    monkeypatch.setattr(Mamba2LM, "fused_tree_greedy", lambda self, *a: None)
    monkeypatch.setattr(Mamba2LM, "fused_draft", lambda self, *a: None)


def assert_same_state(cache, reference, tol=1e-5):
    """``cache`` holds ``reference``'s state: lengths equal, every SSM and conv state, and each row's
    keys and values up to its length, within ``tol``."""
    assert torch.equal(cache.seqlens, reference.seqlens)
    torch.testing.assert_close(cache.ssm, reference.ssm, atol=tol, rtol=tol)
    torch.testing.assert_close(cache.conv, reference.conv, atol=tol, rtol=tol)
    if reference.k is not None:
        for b, n in enumerate(reference.seqlens.tolist()):
            torch.testing.assert_close(cache.k[:, b, :n], reference.k[:, b, :n], atol=tol, rtol=tol)
            torch.testing.assert_close(cache.v[:, b, :n], reference.v[:, b, :n], atol=tol, rtol=tol)
