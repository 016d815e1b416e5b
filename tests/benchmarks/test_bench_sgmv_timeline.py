"""The timeline benchmark's arithmetic on hand-made records, and the kernels' timeline rows."""

import pytest
import torch

from benchmarks.bench_sgmv_timeline import (
    kernel_spans,
    layer_programs,
    median_spans,
    parse_cases,
    timer_step_ns,
)


def program(start, located, waited, end, sm=0):
    return [start, located, waited, end, sm]


class TestKernelSpans:
    # launch 0 ends at 1,000 ns; launch 1: two programs with items and an idle one; launch 2: one
    records = [
        [program(100, 200, 300, 900), program(150, 250, 350, 1000)],
        [program(800, 900, 1500, 2100), program(850, 950, 1600, 2000), program(870, 0, 0, 1700)],
        [program(1200, 1300, 2500, 3000)],
    ]
    grids = [2, 3, 1]

    def test_times_are_from_the_end_of_the_launch_before(self):
        first, second = kernel_spans(self.records, self.grids, 1, 2)
        assert first.start_first == pytest.approx(-0.2)
        assert first.start_last == pytest.approx(-0.13)
        assert first.located_last == pytest.approx(-0.05)
        assert (first.waited_first, first.waited_last) == (pytest.approx(0.5), pytest.approx(0.6))
        assert first.end_last == pytest.approx(1.1)
        assert second.end_last == pytest.approx(2.0)

    def test_release_follows_the_previous_kernels_last_end(self):
        first, second = kernel_spans(self.records, self.grids, 1, 2)
        assert first.release == pytest.approx(0.5)  # 1,500 - 1,000 ns
        assert second.release == pytest.approx(0.4)  # 2,500 - 2,100 ns

    def test_programs_without_an_item_count_in_the_grid_only(self):
        first, _ = kernel_spans(self.records, self.grids, 1, 2)
        assert (first.programs, first.with_item) == (3, 2)
        assert first.after_wait == pytest.approx(0.5)  # median of 0.6 and 0.4

    def test_programs_past_the_grid_are_ignored(self):
        records = [row + [program(1, 1, 1, 10**9)] for row in self.records]
        assert kernel_spans(records, self.grids, 1, 2) == kernel_spans(
            self.records, self.grids, 1, 2)

    def test_layer_programs_share_the_clock_and_keep_their_sm(self):
        records = [[p[:4] + [i] for i, p in enumerate(row)] for row in self.records]
        before, first, second = layer_programs(records, self.grids, 1, 2)
        assert before[1] == [pytest.approx(-0.85), pytest.approx(-0.75), pytest.approx(-0.65),
                             0.0, 1]
        assert first[2] == [pytest.approx(-0.13), None, None, pytest.approx(0.7), 2]
        assert len(second) == 1 and second[0][3] == pytest.approx(2.0)

    def test_the_first_launch_has_no_clock(self):
        with pytest.raises(ValueError, match="launch before"):
            kernel_spans(self.records, self.grids, 0, 1)

    def test_medians_over_replays_skip_missing_fields(self):
        spans = kernel_spans(self.records, self.grids, 1, 2)
        later = [s.__class__(**{**s.__dict__, "end_last": s.end_last + 1.0}) for s in spans]
        idle = [s.__class__(**{**s.__dict__, "release": None}) for s in spans]
        rows = median_spans([spans, later, idle])
        assert rows[0]["end_last"] == pytest.approx(1.1)  # 1.1, 2.1, 1.1
        assert rows[0]["release"] == pytest.approx(0.5)


def test_timer_step_is_the_closest_pair_of_starts():
    records = [[program(100, 0, 0, 1), program(132, 0, 0, 1), program(132, 0, 0, 1)],
               [program(500, 0, 0, 1), program(540, 0, 0, 1), program(0, 0, 0, 0)]]
    assert timer_step_ns(records, [3, 3]) == 32


def test_cases_parse_tokens_adapters_and_ranks():
    one, mixed = parse_cases("8:1:64,8:8:mixed")
    assert (one.seg_lens, one.ranks) == ((8,), (64,))
    assert mixed.seg_lens == (1,) * 8 and mixed.ranks == (8, 16, 32, 64) * 2
    with pytest.raises(SystemExit):
        parse_cases("8:3:16")


class TestTimelineRows:
    def test_launches_take_rows_in_order_until_full(self):
        from kernels.sgmv_triton import Timeline

        timeline = Timeline(2, 5, torch.device("cpu"))
        assert timeline.records.shape == (2, 6, 5)  # rows of an even width: 16-byte aligned
        assert timeline.take_row(4) == 0 and timeline.take_row(6) == 1
        with pytest.raises(RuntimeError, match="2 launches"):
            timeline.take_row(1)

    def test_a_grid_wider_than_a_row_is_refused(self):
        from kernels.sgmv_triton import Timeline

        with pytest.raises(RuntimeError, match="of 6 programs"):
            Timeline(2, 6, torch.device("cpu")).take_row(7)
