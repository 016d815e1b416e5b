"""Steps that run while adapters are read, copied into slots and prefetched make the host wait
for the device once each: for the sampled tokens (`HostStaging.readback`). Every other wait is
counted and must be absent: event, stream and device synchronizations (torch's GPU trace
callbacks, `tests/gpu/host_waits.py`), blocking copies (sync debug mode "error") and the caching
allocator's synchronizing frees.

No adapter is in a slot or in host memory when the counted loop starts: their disk reads, host
-> GPU copies and prefetches all happen while steps run, and requests arrive mid-step too. Each
copy is held back on the load stream for about 10 ms, so steps are enqueued and run with
copies still in flight (counted, and asserted), and in prefetch mode the prefetcher starts some
of them, from the waiting requests and from hints of the coming arrivals. A
base-model request decodes throughout, so every step samples (a step that samples nothing has
no readback, and its successor may wait on a fence instead: `HostStaging.reset`). The blocking
loading mode is left out: it reads and copies on the step thread by design.

The counted loop runs in a process of its own: once torch's GPU trace is on it stays on for the
process, and a CUDA tensor freed while a Python exception is pending (as when sync debug mode
refuses a readback in test_sync_free.py) then fails inside the trace hook."""

import multiprocessing
import time

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.request import Request, SamplingParams
from tests.factories import make_adapter, make_model
from tests.gpu.host_waits import HostWaits

pytestmark = pytest.mark.gpu

NUM_ADAPTERS = 6
SLOTS = 4  # fewer than the adapters: slots are reused during the loop
LENGTHS = [40, 130, 9, 75, 150, 22, 60, 100]  # prompts of the counted requests; 64-token steps
MAX_TOKENS = 8
COPY_DELAY_CYCLES = 20_000_000  # about 10 ms of the load stream, longer than a step's launches


def counted_loop(model_dir: str, adapters: tuple[tuple[str, str], ...], mode: str) -> dict:
    """Build the engine, warm it on a base-model request (the keeper), then step while the
    requests for the adapters arrive and their adapters load, counting the host's waits.
    Returns the counts and what the loop did; runs in a child process (module docstring)."""
    engine = Engine(
        EngineConfig(
            model=model_dir,
            device="cuda",
            num_kv_blocks=512,
            max_num_seqs=16,
            max_num_batched_tokens=64,  # long prompts take several chunks
            max_loras_per_batch=SLOTS,
            max_lora_rank=24,
            adapter_loading=mode,
            adapters=adapters,
        )
    )
    keeper_params = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)
    keeper = Request("keeper", [5, 6, 7, 8], keeper_params)
    engine.add_request(keeper)
    while len(keeper.output_token_ids) < 3:  # its prefill and first decodes: caches warm
        engine.step()
    torch.cuda.synchronize()
    cold = not engine.adapters.slots.resident and not len(engine.adapters.host)

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [
        Request(
            f"r{i}",
            torch.randint(2, 250, (n,), generator=gen).tolist(),
            params,
            f"a{i % NUM_ADAPTERS}",
        )
        for i, n in enumerate(LENGTHS)
    ]
    for request in requests[:3]:
        engine.add_request(request)
    arrivals = requests[3:]  # one arrives during each of the next steps

    # This model's adapters copy in microseconds: each copy first holds the load stream for
    # COPY_DELAY_CYCLES, so it is still in flight while later steps are enqueued and run.
    uploader = engine.adapters.uploader
    upload = uploader.upload

    def slow_upload(slot, weights):
        with torch.cuda.stream(uploader.stream):
            torch.cuda._sleep(COPY_DELAY_CYCLES)
        upload(slot, weights)

    uploader.upload = slow_upload
    in_flight_steps = 0  # steps that ran while a copy into a slot was still on the load stream

    def on_idle():
        # Runs while the device computes the step. `queued_bytes` queries events, never waits.
        nonlocal in_flight_steps
        if not on_idle.counted:
            in_flight_steps += uploader.queued_bytes() > 0
            on_idle.counted = True
        if arrivals and not on_idle.done:
            if not on_idle.hinted:  # the router's hints: every arrival is coming, in order
                for i, request in enumerate(arrivals[1:], 1):
                    engine.prefetch_hint(request.adapter, eta_s=0.002 * i)
                on_idle.hinted = True
            engine.add_request(arrivals.pop(0))
            on_idle.done = True

    on_idle.hinted = False

    sampled_steps = steps = 0
    first_step = engine.num_steps
    with HostWaits() as waits:
        # The counters are live: one wait of each kind, counted, then left out.
        torch.cuda.current_stream().synchronize()
        marker = torch.cuda.Event()
        marker.record()
        marker.synchronize()
        live = waits.streams == 1 and waits.events[marker.cuda_event] == 1
        waits.streams = 0
        del waits.events[marker.cuda_event]

        torch.cuda.set_sync_debug_mode("error")
        try:
            while arrivals or not all(r.is_finished for r in requests):
                if keeper.is_finished:
                    break  # the keeper ran out: steps would stop sampling (asserted below)
                on_idle.done = on_idle.counted = False
                outputs = engine.step(on_idle=on_idle)
                steps += 1
                sampled_steps += any(o.new_token_ids for o in outputs)
                if any(r.num_computed_tokens == 0 for r in requests):
                    time.sleep(0.001)  # reads in flight: give them time, not the keeper's tokens
        finally:
            torch.cuda.set_sync_debug_mode("default")

    readback = engine.runner.staging._done.cuda_event
    stats = engine.adapters.stats
    return dict(
        cold=cold,
        live=live,
        keeper_ran_out=keeper.is_finished,
        steps=steps,
        sampled_steps=sampled_steps,
        readback_waits=waits.events[readback],
        other_event_waits={h: n for h, n in waits.events.items() if h != readback},
        stream_waits=waits.streams,
        device_waits=waits.devices,
        allocator_waits=waits.allocator,
        elsewhere=dict(waits.elsewhere),
        disk_reads=stats.disk_reads,
        gpu_loads=stats.gpu_loads,
        gated_steps=sum(t.gated for t in engine.step_timings(first_step)),
        in_flight_steps=in_flight_steps,
        prefetch_loads=stats.prefetch_loads,
        tokens=[len(r.output_token_ids) for r in requests],
    )


@pytest.mark.parametrize("mode", ["overlap", "prefetch"])
def test_steps_during_loads_wait_only_for_their_tokens(tmp_path, mode):
    model_dir = make_model(
        tmp_path / "m",
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=2048,
    )
    adapters = tuple(  # ranks 4 to 24
        (f"a{i}", str(make_adapter(model_dir, tmp_path / f"a{i}", rank=4 * (i + 1), seed=i)))
        for i in range(NUM_ADAPTERS)
    )
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        run = pool.apply_async(counted_loop, (str(model_dir), adapters, mode))
        counts = run.get(timeout=300)

    assert counts["cold"], "adapters were loaded before the counted loop"
    assert counts["live"], "the GPU trace callbacks did not count a deliberate wait"
    assert not counts["keeper_ran_out"], "the keeper finished: not every step sampled"
    # The budget: one wait a step, on the readback's event, and nothing else.
    assert counts["readback_waits"] == counts["sampled_steps"] == counts["steps"], counts
    assert not counts["other_event_waits"], counts
    assert counts["stream_waits"] == counts["device_waits"] == 0, counts
    assert counts["allocator_waits"] == {"num_sync_all_streams": 0, "num_device_free": 0}
    # The loads really overlapped the steps: every adapter read and loaded while the loop ran,
    # some into slots another adapter left, and steps waited (on the device) for their copies.
    assert counts["disk_reads"] == NUM_ADAPTERS and counts["gpu_loads"] > SLOTS, counts
    assert counts["gated_steps"] > 0, counts
    assert counts["in_flight_steps"] > 0, counts
    if mode == "prefetch":  # the prefetcher, not admission, started some of those copies
        assert counts["prefetch_loads"] > 0, counts
    assert counts["tokens"] == [MAX_TOKENS] * len(LENGTHS)
