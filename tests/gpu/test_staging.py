"""Pinned staging of step metadata: a reset must never let a later write reach a copy that the
device has not run yet, and should not make the host wait for the device."""

import pytest
import torch

from replicas.staging import HostStaging

pytestmark = pytest.mark.gpu
BUSY_CYCLES = 1_000_000_000  # about half a second of a spinning kernel on an H100


def test_a_reset_before_any_readback_keeps_the_queued_copies_values():
    # A step that samples nothing (a prefill chunk) has no readback, and the device may still be
    # a step behind: that step's copies must read that step's values.
    stage = HostStaging(torch.device("cuda"))
    torch.cuda._sleep(BUSY_CYCLES)  # the copies below queue behind this
    first = stage.tensor(list(range(1000)), torch.int64)
    stage.reset()
    assert not torch.cuda.current_stream().query()  # no wait: the next step writes elsewhere
    second = stage.tensor([-1] * 1000, torch.int64)
    torch.cuda.synchronize()
    assert first.tolist() == list(range(1000))
    assert second.tolist() == [-1] * 1000


def test_coming_back_to_a_buffer_with_queued_copies_waits_for_them():
    stage = HostStaging(torch.device("cuda"))
    torch.cuda._sleep(BUSY_CYCLES)
    first = stage.tensor(list(range(1000)), torch.int64)
    first_copied = torch.cuda.Event()
    first_copied.record()
    stage.reset()
    second = stage.tensor(list(range(1000, 2000)), torch.int64)
    stage.reset()  # back to the first buffer, whose copy still waits behind the spin
    assert first_copied.query()  # so this reset waited for it
    third = stage.tensor([-1] * 1000, torch.int64)
    torch.cuda.synchronize()
    assert first.tolist() == list(range(1000))
    assert second.tolist() == list(range(1000, 2000))
    assert third.tolist() == [-1] * 1000


def test_a_reset_after_a_readback_does_not_wait_for_the_device():
    stage = HostStaging(torch.device("cuda"))
    tokens = stage.tensor([3, 1, 4], torch.int64)
    assert stage.readback(tokens) == [3, 1, 4]
    torch.cuda._sleep(BUSY_CYCLES)
    stage.reset()
    assert not torch.cuda.current_stream().query()  # the spin still runs: reset did not wait
    torch.cuda.synchronize()


def test_copies_on_a_side_stream_are_fenced_too():
    stage = HostStaging(torch.device("cuda"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        first = stage.tensor(list(range(1000)), torch.int64)
    tokens = stage.tensor([7], torch.int64)
    assert stage.readback(tokens) == [7]  # waits for the current stream only
    stage.reset()
    stage.tensor([-1] * 1000, torch.int64)
    stage.reset()
    stage.tensor([-2] * 1000, torch.int64)  # the first buffer again, after the side stream's copy
    torch.cuda.synchronize()
    assert first.tolist() == list(range(1000))
