"""Bad arguments to generate end in a ValueError/TypeError that names the argument and the value
(issue 16, "Arguments"); NumPy integers are integers."""

import numpy as np
import pytest
from tiny_models import VOCAB, mamba2

from stree.decoding.args import integer
from stree.decoding.loop import generate
from stree.sampling.verify import SamplingParams


@pytest.fixture(scope="module")
def model():
    return mamba2()


@pytest.mark.parametrize("kw, error, message", [
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an integer, got True"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an integer, got 2.0"),
    (dict(max_new_tokens=0), ValueError, r"max_new_tokens must be in \[1, inf\], got 0"),
    (dict(eos_token_id="a"), TypeError, "eos_token_id must be an integer, got 'a'"),
    (dict(eos_token_id=2.5), TypeError, "eos_token_id must be an integer, got 2.5"),
    (dict(eos_token_id=[1, 10**6]), ValueError, r"eos_token_id must be in \[0, 95\], got 1000000"),
    (dict(eos_token_id=-1), ValueError, r"eos_token_id must be in \[0, 95\], got -1"),
    (dict(seed=2**70), ValueError, r"seed must be in \[0, 9223372036854775807\], got 1180591620717411303424"),
    (dict(seed="0"), TypeError, "seed must be an integer, got '0'"),
    (dict(max_length=True), TypeError, "max_length must be an integer, got True"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a number >= 0, got nan"),
    (dict(temperature=float("inf")), ValueError, "temperature must be finite, got inf"),
    (dict(temperature=True), ValueError, "temperature must be a number >= 0, got True"),
    (dict(top_k=1.5), ValueError, r"top_k must be an int >= 0 \(0 disables it\), got 1.5"),
    (dict(top_p=float("nan")), ValueError, r"top_p must be in \(0, 1\], got nan"),
])
def test_generate_names_the_bad_argument(model, kw, error, message):
    with pytest.raises(error, match=message):
        generate(model, [[1, 2, 3]], **{"max_new_tokens": 3, **kw})


def test_numpy_integers_are_integers(model):
    want = generate(model, [[1, 2, 3]], max_new_tokens=4, eos_token_id=5, seed=1, temperature=0.7, top_k=5)
    got = generate(model, [[1, 2, 3]], max_new_tokens=np.int64(4), eos_token_id=[np.int32(5)], seed=np.uint8(1),
                   temperature=np.float32(0.7), top_k=np.int64(5))
    assert got.sequences == want.sequences
    assert model.vocab_size - 1 == 95 and VOCAB == 90  # the bounds the messages above quote


def test_sampling_params_refuse_non_finite_temperature():
    for t in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature must be"):
            SamplingParams(temperature=t)


def test_integer_helper():
    assert integer("n", np.int16(3), low=0) == 3 and type(integer("n", np.int16(3))) is int
    with pytest.raises(ValueError, match=r"n must be in \[-inf, 2\], got 3"):
        integer("n", 3, high=2)


def test_the_wrappers_take_exactly_the_arguments_of_what_they_wrap():
    """generate is decode run to its end, dvts beam search with another grouping: their
    signatures are written out (help() and editors read them) and must not drift apart."""
    import inspect

    from stree.decoding.loop import decode
    from stree.patterns.search import beam_search, dvts

    params = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert params(generate) == params(decode)
    assert params(dvts) == params(beam_search)
