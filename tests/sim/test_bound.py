"""The floor on any router's loads: Belady's MIN over the requests in arrival order, checked on
sequences small enough to work out by hand, and the fleet-as-one-LRU-cache figure beside it."""

from __future__ import annotations

import math
import random

import pytest

from sim.bound import (
    a0_miss_rate,
    a0_misses,
    belady_misses,
    fleet_bound,
    lru_misses,
    warm_floor,
)
from sim.cells import CELLS

# The textbook reference string: with 3 frames the optimal replacement faults 7 times and LRU
# 10; with 4 frames, 6 and 8.
TEXTBOOK = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]


class TestBelady:
    def test_the_textbook_string(self):
        assert belady_misses(TEXTBOOK, 3) == 7 and lru_misses(TEXTBOOK, 3) == 10
        assert belady_misses(TEXTBOOK, 4) == 6 and lru_misses(TEXTBOOK, 4) == 8

    def test_it_gives_up_the_entry_used_again_latest(self):
        # A B C A B over two entries: C arrives, B is used again after A, so B goes; A hits,
        # B misses. LRU gives up A instead and misses every time.
        assert belady_misses("ABCAB", 2) == 4 and lru_misses("ABCAB", 2) == 5

    def test_room_for_everything_misses_each_adapter_once(self):
        assert belady_misses("ABCABCA", 3) == 3 == lru_misses("ABCABCA", 3)

    def test_never_more_than_lru(self):
        rng = random.Random(0)
        for _ in range(50):
            seq = [rng.randrange(12) for _ in range(rng.randrange(1, 80))]
            for capacity in (1, 3, 8):
                assert belady_misses(seq, capacity) <= lru_misses(seq, capacity)

    def test_a_cache_needs_an_entry(self):
        with pytest.raises(ValueError):
            belady_misses("AB", 0)
        with pytest.raises(ValueError):
            lru_misses("AB", 0)


class TestWarmFloor:
    def test_whatever_the_cache_held_first(self):
        # A B C A B over two entries started with {A, B}: C misses (B goes), A hits, B misses:
        # 2, which the floor (4 from empty, less 2) reaches.
        assert warm_floor("ABCAB", 2) == 2
        assert warm_floor("ABAB", 2) == 0

    def test_lru_after_a_warm_up_does_not_beat_it(self):
        rng = random.Random(1)
        for _ in range(50):
            warm = [rng.randrange(10) for _ in range(20)]
            seq = [rng.randrange(10) for _ in range(60)]
            assert warm_floor(seq, 4) <= lru_misses(seq, 4, warm)


class TestOnlineFloor:
    """A0 under the independent reference model: the fewest expected misses of a cache that
    does not know the requests to come."""

    def test_a_case_worked_by_hand(self):
        # p = (0.5, 0.3, 0.2), two entries: A0 keeps the first; the other entry holds the last
        # of the other two requested (the second with probability 0.3 / 0.5). Misses a request:
        # 0.3 x 0.4 + 0.2 x 0.6 = 0.24, above 1 - (0.5 + 0.3) = 0.2.
        assert a0_miss_rate([0.5, 0.3, 0.2], 2) == pytest.approx(0.24)
        # One entry misses unless the same item comes again: 1 - sum(p^2).
        assert a0_miss_rate([0.5, 0.3, 0.2], 1) == pytest.approx(0.62)
        assert a0_miss_rate([0.5, 0.3, 0.2], 3) == 0 == a0_miss_rate([0.5, 0.3, 0.2], 5)

    def test_the_rate_is_what_a0_misses_over_a_long_stream(self):
        probabilities = {item: 1 / (item + 1) for item in range(20)}  # Zipf 1.0
        total = sum(probabilities.values())
        probabilities = {item: p / total for item, p in probabilities.items()}
        rng = random.Random(0)
        stream = rng.choices(list(probabilities), list(probabilities.values()), k=100_000)
        for capacity in (1, 4, 10):
            rate = a0_miss_rate(list(probabilities.values()), capacity)
            assert a0_misses(stream, probabilities, capacity) / len(stream) == pytest.approx(
                rate, abs=0.01
            )
            # LRU, not knowing the popularity either, misses more (with one entry both hold
            # the last item requested).
            lru = lru_misses(stream, capacity) / len(stream)
            assert lru > rate + 0.01 if capacity > 1 else lru == pytest.approx(rate, abs=0.01)

    def test_a0_keeps_the_most_probable_and_moves_one_entry(self):
        probabilities = {"a": 0.6, "b": 0.3, "c": 0.1}
        # Holds a and b; c misses and takes b's entry, b misses and takes it back.
        assert a0_misses("abcbab", probabilities, 2) == 2
        assert a0_misses("abcbab", probabilities, 3) == 0

    def test_probabilities_must_sum_to_one(self):
        with pytest.raises(ValueError):
            a0_miss_rate([0.5, 0.2], 1)
        with pytest.raises(ValueError):
            a0_miss_rate([0.5, 0.5], 0)


class TestFleet:
    def test_per_1k_requests_the_base_model_needing_no_slot(self):
        b = fleet_bound(["a", None, "b", "a", None, "c", "a", "b"], 2, 3, warmup=["a", "b"])
        # adapters a b a c a b: MIN from empty misses a, b, c, b (4), less 2 entries; LRU warm
        # with {a, b} misses c (a stays: used just before), then b.
        assert b.loads_floor_per_1k == 1000 * 2 / 8
        assert b.lru_loads_per_1k == 1000 * 2 / 8
        assert b.disk_reads_floor_per_1k == 0 and b.lru_disk_reads_per_1k == 1000 * 1 / 8

    def test_placement_2x(self):
        # docs/perf/routing_sim.md: no router halves pow2's 452 loads per 1k there (226).
        b = CELLS["placement-2x"].bound()
        assert (b.gpu_entries, b.memory_entries) == (32, 128)
        assert b.loads_floor_per_1k == 230.0 and b.disk_reads_floor_per_1k == 46.25
        assert b.loads_floor_per_1k < b.lru_loads_per_1k and b.lru_loads_per_1k < 452
        # Not knowing the future: A0 expects 340 (1 - the top 32 of Zipf 1.0 over 256: 337).
        assert b.online_loads_floor_per_1k == pytest.approx(340.3, abs=0.1)
        assert b.loads_floor_per_1k < b.a0_loads_per_1k < b.lru_loads_per_1k

    def test_placement_4x_online(self):
        # Belady's 146 is under half of pow2's 306 measured (153); a router that does not know
        # the requests to come expects at least 227 (A0 over 64 slots), and A0 makes 201 on
        # these requests.
        b = CELLS["placement-4x"].bound()
        assert b.gpu_entries == 64 and round(b.loads_floor_per_1k) == 146
        assert b.online_loads_floor_per_1k == pytest.approx(226.6, abs=0.1)
        assert b.a0_loads_per_1k == pytest.approx(200.6, abs=0.1)
        # The host caches hold the whole catalogue together: no disk read is needed.
        assert b.online_disk_reads_floor_per_1k == 0 == b.disk_reads_floor_per_1k

    def test_no_popularity_no_online_floor(self):
        b = fleet_bound(["a", "b", "a"], 1, 2)
        assert math.isnan(b.online_loads_floor_per_1k) and math.isnan(b.a0_loads_per_1k)
