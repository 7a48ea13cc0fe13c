"""A model made under ``torch.inference_mode`` (its parameters inference tensors, which keep no
version counter: the keys of the copies and bound kernels made of parameters read them) decodes
as the same model made outside it, greedy and speculative, eager."""

import pytest
import torch
from tiny_models import FAMILIES, VOCAB

from stree.decoding.loop import generate
from stree.drafters import NGramDrafter


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_made_under_inference_mode_decodes_as_one_made_outside(family):
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    ids[:, 4:] = ids[:, :3]  # (a repeat for the n-gram drafter to follow)
    want = [generate(FAMILIES[family](), ids, max_new_tokens=12, drafter=d).sequences
            for d in (None, NGramDrafter())]
    with torch.inference_mode():
        model = FAMILIES[family]()
        assert model.embed.weight.is_inference()
        got = [generate(model, ids, max_new_tokens=12, drafter=d).sequences for d in (None, NGramDrafter())]
    assert got == want
