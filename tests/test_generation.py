"""Chapter 1's generation loop and the samplers: greedy, temperature, top-k, top-p, stop tokens, bad input."""

import numpy as np
import pytest
from helpers import TINY, tiny_model

import gpt2_core
from gpt2_core import InvalidInputError, SamplingParams
from gpt2_core.ch01_forward.generation import next_token_logits
from gpt2_core.ch01_forward.sampling import Sampler, sampling_probs


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_greedy_is_argmax_of_the_full_forward(model):
    prompt = [1, 2, 3]
    out = gpt2_core.generate(model, prompt, 8, stop_at_eos=False)
    ids = list(prompt)
    for token in out:
        assert token == int(np.argmax(gpt2_core.forward(model, ids)[-1]))
        ids.append(token)
    np.testing.assert_allclose(next_token_logits(model, ids), gpt2_core.forward(model, ids)[-1], atol=1e-6)


def test_stream_yields_the_same_tokens_one_at_a_time(model):
    stream = gpt2_core.generate_stream(model, [4, 5], 6, temperature=0.9, seed=7)
    assert next(stream) is not None
    assert [*gpt2_core.generate_stream(model, [4, 5], 6, temperature=0.9, seed=7)] == gpt2_core.generate(
        model, [4, 5], 6, temperature=0.9, seed=7)


def test_generation_stops_after_end_of_text():
    m = tiny_model()
    m.params["ln_f"]["bias"][:] = 0
    m.params["wte"][TINY.eos_token_id] *= 0
    m.params["wte"][TINY.eos_token_id, 0] = 1e3
    m.params["ln_f"]["bias"][0] = 50  # the hidden state points at the eos embedding: eos always wins
    out = gpt2_core.generate(m, [1, 2], 10)
    assert out == [TINY.eos_token_id]
    assert len(gpt2_core.generate(m, [1, 2], 10, stop_at_eos=False)) == 10


def test_same_seed_same_tokens_other_seed_other_tokens(model):
    a = gpt2_core.generate(model, [1], 12, temperature=1.5, seed=1, stop_at_eos=False)
    assert a == gpt2_core.generate(model, [1], 12, temperature=1.5, seed=1, stop_at_eos=False)
    assert a != gpt2_core.generate(model, [1], 12, temperature=1.5, seed=2, stop_at_eos=False)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = gpt2_core.generate(model, [9, 8], 8, stop_at_eos=False)
    assert gpt2_core.generate(model, [9, 8], 8, temperature=2.0, top_k=1, seed=3, stop_at_eos=False) == greedy
    assert gpt2_core.generate(model, [9, 8], 8, temperature=2.0, top_p=1e-9, seed=3, stop_at_eos=False) == greedy


def test_sampling_probs_cut_to_top_k_and_top_p():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [5 / 7, 2 / 7, 0, 0, 0])
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.2 < 0.8 <= + 0.15
    np.testing.assert_allclose(p, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # reaches 0.7 exactly at 2 tokens
    np.testing.assert_allclose(p, np.array([0.5, 0.2, 0, 0, 0]) / 0.7)
    hot = sampling_probs(logits, SamplingParams(temperature=100.0))
    assert hot.max() - hot.min() < 0.02  # high temperature flattens the distribution


def test_sampler_draws_follow_the_distribution():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    sample = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount([sample(logits) for _ in range(20000)], minlength=3) / 20000
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.015)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -3}, "seed"),
])
def test_bad_sampling_parameters_are_named(model, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        gpt2_core.generate(model, [1, 2], 3, **kwargs)


def test_bad_prompts(model):
    with pytest.raises(InvalidInputError, match="empty"):
        gpt2_core.generate(model, [], 3)
    with pytest.raises(InvalidInputError, match=r"token id 101 is out of range \[0, 101\)"):
        gpt2_core.forward(model, [1, 101])
    with pytest.raises(InvalidInputError, match=r"token id -1 is out of range"):
        gpt2_core.generate(model, [-1], 1)
    with pytest.raises(InvalidInputError, match=r"17 tokens is longer than the context n_ctx=16"):
        gpt2_core.forward(model, list(range(17)))
    with pytest.raises(InvalidInputError, match=r"prompt of 10 tokens \+ max_new_tokens=8 needs 17 positions, more "
                                                r"than the context n_ctx=16"):
        gpt2_core.generate(model, list(range(10)), 8)
    with pytest.raises(InvalidInputError, match="integers"):
        gpt2_core.forward(model, [1.5, 2.0])
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        gpt2_core.generate(model, [1], -2)
    assert len(gpt2_core.generate(model, list(range(10)), 7, stop_at_eos=False)) == 7  # 10 + 7 - 1 = n_ctx fits


def test_sampling_at_a_vanishing_temperature_is_greedy_and_bad_logits_are_refused():
    logits = np.array([1.0, 5.0, 2.0, 3.0], dtype=np.float32)
    for seed in range(5):  # logits / 1e-308 overflow: the limit T -> 0, not the first token
        assert Sampler(SamplingParams(1e-308, seed=seed))(logits) == 1
    for bad in ([np.nan, 1.0, 2.0], [-np.inf, -np.inf, -np.inf]):
        with pytest.raises(InvalidInputError, match="NaN or all -inf"):
            Sampler(SamplingParams(0.7, seed=0))(np.array(bad))


def test_a_draw_at_the_top_of_the_unit_interval_never_picks_a_filtered_token():
    """The cumulative sum of float64 probabilities can end a hair below 1; a draw u just under 1 must still land
    on a token that has probability, never on a trailing one that top-k set to zero."""
    logits = np.random.default_rng(0).standard_normal(50257).astype(np.float32)
    sampler = Sampler(SamplingParams(1.0, top_k=5, seed=0))
    sampler.rng = type("Top", (), {"random": staticmethod(lambda: 1 - 2.0 ** -53)})()
    token = sampler(logits)
    assert sampling_probs(logits, SamplingParams(1.0, top_k=5))[token] > 0
