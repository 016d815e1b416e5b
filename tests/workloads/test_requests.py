"""The workload: adapter popularity, lengths, prompts, seeding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from workloads.popularity import pick_adapters, popularity_weights
from workloads.requests import (
    LengthRange,
    WorkloadConfig,
    build_workload,
    workload_digest,
)

ADAPTERS = tuple(f"ad-{i}" for i in range(6))


def config(**overrides) -> WorkloadConfig:
    fields = dict(
        num_prompts=600,
        input_len=LengthRange(20, 60),
        output_len=LengthRange(5, 9),
        adapters=ADAPTERS,
        base_model="base",
    )
    return WorkloadConfig(**{**fields, **overrides})


def frequencies(specs) -> list[int]:
    counts = Counter(s.model for s in specs)
    return [counts[a] for a in ADAPTERS]


class TestPopularity:
    def test_distinct_is_exact_round_robin(self):
        specs = build_workload(config(popularity="distinct", num_prompts=20))
        assert [s.model for s in specs] == [ADAPTERS[i % 6] for i in range(20)]

    def test_uniform_visits_every_adapter_about_equally(self):
        counts = frequencies(build_workload(config(popularity="uniform", num_prompts=6000)))
        assert min(counts) > 0.8 * 1000 and max(counts) < 1.2 * 1000

    def test_skewed_frequencies_fall_geometrically(self):
        counts = frequencies(build_workload(config(popularity="skewed", alpha=0.5)))
        assert counts == sorted(counts, reverse=True)
        assert counts[0] / counts[1] == pytest.approx(2.0, rel=0.25)

    def test_zipf_frequencies_fall_with_rank(self):
        counts = frequencies(build_workload(config(popularity="zipf", zipf_s=1.2)))
        assert counts[0] > counts[1] > counts[2] > counts[5]

    def test_hot_gives_the_first_adapter_half_the_requests(self):
        w = popularity_weights("hot", 8)
        assert w[0] == pytest.approx(0.5) and np.allclose(w[1:], 0.5 / 7)

    def test_weights_are_probabilities(self):
        for kind in ("distinct", "uniform", "skewed", "zipf", "hot"):
            w = popularity_weights(kind, 10, alpha=0.6, zipf_s=1.5)
            assert w.shape == (10,) and w.sum() == pytest.approx(1.0)
        np.testing.assert_allclose(
            popularity_weights("zipf", 3, zipf_s=1.0), np.array([1, 1 / 2, 1 / 3]) / (11 / 6)
        )

    def test_draws_stay_in_range(self):
        picks = pick_adapters("zipf", 4, 1000, np.random.default_rng(0))
        assert picks.min() >= 0 and picks.max() < 4

    @pytest.mark.parametrize(
        "overrides", [{"popularity": "nope"}, {"alpha": 0.0}, {"alpha": 1.5}, {"zipf_s": 0.0}]
    )
    def test_bad_parameters_are_refused(self, overrides):
        with pytest.raises(ValueError):
            config(**overrides)


class TestBaseModel:
    def test_base_fraction_sends_that_share_to_the_base(self):
        specs = build_workload(config(base_fraction=0.25, num_prompts=4000))
        share = sum(s.is_base for s in specs) / len(specs)
        assert share == pytest.approx(0.25, abs=0.03)
        assert all(s.model == "base" for s in specs if s.is_base)
        assert all(s.model in ADAPTERS for s in specs if not s.is_base)

    def test_distinct_round_robin_skips_base_requests(self):
        specs = build_workload(config(popularity="distinct", base_fraction=0.3, num_prompts=60))
        adapter_models = [s.model for s in specs if not s.is_base]
        assert adapter_models == [ADAPTERS[i % 6] for i in range(len(adapter_models))]

    def test_without_adapters_everything_goes_to_the_base(self):
        specs = build_workload(config(adapters=(), num_prompts=10))
        assert {s.model for s in specs} == {"base"} and all(s.is_base for s in specs)

    def test_base_requests_need_the_base_name(self):
        with pytest.raises(ValueError, match="base model"):
            config(base_model=None, base_fraction=0.1)


class TestLengths:
    def test_lengths_stay_in_range_and_cover_it(self):
        specs = build_workload(config(num_prompts=2000))
        inputs = {s.input_len for s in specs}
        outputs = {s.output_len for s in specs}
        assert inputs == set(range(20, 61))
        assert outputs == set(range(5, 10))

    def test_token_prompts_have_input_len_ids_below_vocab_size(self):
        specs = build_workload(config(vocab_size=50, num_prompts=50))
        for s in specs:
            assert isinstance(s.prompt, tuple) and len(s.prompt) == s.input_len
            assert all(0 <= t < 50 for t in s.prompt)

    def test_text_prompts_have_input_len_words(self):
        specs = build_workload(config(prompt_kind="text", num_prompts=20))
        assert all(len(s.prompt.split()) == s.input_len for s in specs)

    @pytest.mark.parametrize(
        "text, expected", [("200:1000", LengthRange(200, 1000)), ("64", LengthRange(64, 64))]
    )
    def test_parse(self, text, expected):
        assert LengthRange.parse(text) == expected

    @pytest.mark.parametrize("text", ["0:5", "9:3", "a:b", ""])
    def test_parse_refuses_bad_ranges(self, text):
        with pytest.raises(ValueError):
            LengthRange.parse(text)


class TestSeeding:
    def test_same_seed_same_workload(self):
        a, b = build_workload(config(seed=3)), build_workload(config(seed=3))
        assert a == b
        assert workload_digest(a) == workload_digest(b)

    def test_other_seed_other_workload(self):
        a, b = build_workload(config(seed=3)), build_workload(config(seed=4))
        assert workload_digest(a) != workload_digest(b)

    def test_popularity_leaves_prompts_and_lengths_alone(self):
        a = build_workload(config(popularity="uniform"))
        b = build_workload(config(popularity="zipf"))
        assert [(s.prompt, s.output_len) for s in a] == [(s.prompt, s.output_len) for s in b]
