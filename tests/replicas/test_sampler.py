"""Sampling parameters, checked as properties of the sampled tokens."""

import pytest
import torch

from replicas.request import Request, SamplingParams
from replicas.sampler import Sampler
from tests.replicas.conftest import make_engine, run_to_completion


@pytest.fixture
def sampler():
    return Sampler(torch.device("cpu"), seed=0)


def draw(sampler, logits, params, n=400, generators=None):
    rows = logits.expand(n, -1).clone()
    return sampler.sample(rows, [params] * n, generators or [None] * n)


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])


def test_greedy_takes_the_argmax(sampler):
    assert set(draw(sampler, LOGITS, SamplingParams(temperature=0.0)).tolist()) == {0}
    assert set(draw(sampler, LOGITS, SamplingParams(top_k=1)).tolist()) == {0}


def test_top_k_limits_the_support(sampler):
    tokens = set(draw(sampler, LOGITS, SamplingParams(temperature=1.0, top_k=3)).tolist())
    assert tokens == {0, 1, 2}


def test_top_p_keeps_the_smallest_nucleus(sampler):
    probs = torch.softmax(LOGITS[0], -1)  # 0.38, 0.23, 0.14, ...
    p = float(probs[0] + probs[1]) - 1e-3  # the first two tokens are needed to reach p
    tokens = set(draw(sampler, LOGITS, SamplingParams(temperature=1.0, top_p=p)).tolist())
    assert tokens == {0, 1}


def test_temperature_sharpens_and_flattens(sampler):
    cold = draw(sampler, LOGITS, SamplingParams(temperature=0.2))
    hot = draw(sampler, LOGITS, SamplingParams(temperature=5.0))
    assert (cold == 0).float().mean() > 0.9
    assert len(set(hot.tolist())) == LOGITS.shape[1]


def test_frequencies_follow_the_distribution(sampler):
    tokens = draw(sampler, LOGITS, SamplingParams(temperature=1.0), n=20000)
    freq = torch.bincount(tokens, minlength=6).float() / 20000
    torch.testing.assert_close(freq, torch.softmax(LOGITS[0], -1), atol=0.02, rtol=0)


def test_seeded_requests_repeat_whatever_shares_the_batch(models):
    engine = make_engine(models["llama"])
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run_to_completion(engine, [Request("a", [5, 6, 7], seeded)])["a"][0]
    crowd = [Request(f"n{i}", [9, i + 1], SamplingParams(max_tokens=10, temperature=1.0))
             for i in range(3)]
    together = run_to_completion(engine, [Request("b", [5, 6, 7], seeded), *crowd])["b"][0]
    assert alone == together
    other = run_to_completion(
        engine, [Request("c", [5, 6, 7], SamplingParams(max_tokens=10, seed=99, ignore_eos=True))]
    )["c"][0]
    assert other != alone


def test_stop_tokens_and_eos_finish_with_stop(models):
    engine = make_engine(models["llama"])
    free = run_to_completion(engine, [Request("f", [5, 6, 7], SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True))])["f"][0]
    stop_at = free[2]
    out = run_to_completion(engine, [Request("s", [5, 6, 7], SamplingParams(
        max_tokens=6, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True))])["s"]
    assert out == (free[: free.index(stop_at) + 1], "stop")
    eos_engine = make_engine(models["llama"], eos_token_ids=(stop_at,))
    out = run_to_completion(eos_engine, [Request("e", [5, 6, 7], SamplingParams(
        max_tokens=6, temperature=0.0))])["e"]
    assert out == (free[: free.index(stop_at) + 1], "stop")


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0), dict(max_tokens=0)],
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
