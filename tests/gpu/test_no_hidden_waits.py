"""Steps that run while adapters are read, copied into slots and prefetched make the host wait
for the device once each: for the sampled tokens (`HostStaging.readback`). Every other wait is
counted and must be absent: event, stream and device synchronizations (torch's GPU trace
callbacks, `tests/gpu/host_waits.py`), blocking copies (sync debug mode "error") and the caching
allocator's synchronizing frees.

No adapter is in a slot or in host memory when the counted loop starts: their disk reads, host
-> GPU copies and prefetches all happen while steps run, and requests arrive mid-step too. A
base-model request decodes throughout, so every step samples (a step that samples nothing has
no readback, and its successor may wait on a fence instead: `HostStaging.reset`). The blocking
loading mode is left out: it reads and copies on the step thread by design."""

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
LENGTHS = [40, 130, 9, 75, 150, 22, 60, 100]  # prompts of the counted requests; 64-token steps


def engine_with_adapters(tmp_path, mode: str) -> Engine:
    """Six adapters of ranks 4 to 24 over four slots, none read yet."""
    model_dir = make_model(
        tmp_path / "m",
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=2048,
    )
    adapters = tuple(
        (f"a{i}", str(make_adapter(model_dir, tmp_path / f"a{i}", rank=4 * (i + 1), seed=i)))
        for i in range(NUM_ADAPTERS)
    )
    return Engine(
        EngineConfig(
            model=str(model_dir),
            device="cuda",
            num_kv_blocks=512,
            max_num_seqs=16,
            max_num_batched_tokens=64,  # long prompts take several chunks
            max_loras_per_batch=4,  # fewer slots than adapters: evictions during the loop
            max_lora_rank=24,
            adapter_loading=mode,
            adapters=adapters,
        )
    )


@pytest.mark.parametrize("mode", ["overlap", "prefetch"])
def test_steps_during_loads_wait_only_for_their_tokens(tmp_path, mode):
    engine = engine_with_adapters(tmp_path, mode)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    keeper = Request(
        "keeper", [5, 6, 7, 8], SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)
    )
    engine.add_request(keeper)
    while len(keeper.output_token_ids) < 3:  # its prefill and first decodes: caches warm
        engine.step()
    torch.cuda.synchronize()
    assert not engine.adapters.slots.resident and not len(engine.adapters.host)

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in LENGTHS]
    requests = [Request(f"r{i}", p, params, f"a{i % NUM_ADAPTERS}") for i, p in enumerate(prompts)]
    for request in requests[:3]:
        engine.add_request(request)
    arrivals = requests[3:]  # one arrives during each of the next steps

    def on_idle():
        if arrivals and not on_idle.done:
            engine.add_request(arrivals.pop(0))
            on_idle.done = True

    staging = engine.runner.staging
    sampled_steps = steps = 0
    first_step = engine.num_steps
    with HostWaits() as waits:
        # The counters are live: one wait of each kind, counted, then left out below.
        torch.cuda.current_stream().synchronize()
        marker = torch.cuda.Event()
        marker.record()
        marker.synchronize()
        assert waits.streams == 1 and waits.events[marker.cuda_event] == 1
        waits.streams = 0
        del waits.events[marker.cuda_event]

        torch.cuda.set_sync_debug_mode("error")
        try:
            while arrivals or not all(r.is_finished for r in requests):
                assert not keeper.is_finished, "the keeper ran out: every step must sample"
                on_idle.done = False
                outputs = engine.step(on_idle=on_idle)
                steps += 1
                sampled_steps += any(o.new_token_ids for o in outputs)
                if any(r.num_computed_tokens == 0 for r in requests):
                    time.sleep(0.001)  # reads in flight: give them time, not the keeper's tokens
        finally:
            torch.cuda.set_sync_debug_mode("default")

    readback = staging._done.cuda_event
    assert waits.events[readback] == sampled_steps == steps  # the budget: one wait a step
    assert waits.total(except_event=readback) == 0, (waits.events, waits.streams, waits.devices)
    assert waits.allocator == {"num_sync_all_streams": 0, "num_device_free": 0}
    # The loads really overlapped the steps: every adapter loaded while the loop ran, some into
    # slots another adapter left, and steps waited (on the device) for copies in flight.
    stats = engine.adapters.stats
    assert stats.disk_reads == NUM_ADAPTERS and stats.gpu_loads > 4
    assert any(t.gated for t in engine.step_timings(first_step)), "no step overlapped a copy"
    assert all(len(r.output_token_ids) == params.max_tokens for r in requests)
