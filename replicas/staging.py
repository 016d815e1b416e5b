"""Host <-> device traffic of one engine step, without blocking copies.

Each step's small metadata tensors (token ids, positions, slot mapping, block tables, segment
bounds, sampling parameters) are written into one pinned host buffer, bump-allocated and reset
every step, and copied to the device with `non_blocking=True`. The sampled tokens come back the
same way, into a pinned output buffer, and the host waits on a CUDA event recorded after that
copy: the step's one wait, and the reason the next step may overwrite the pinned buffers (all
copies that read them were enqueued before the event).

A step without a readback (a middle chunk of a chunked prefill samples nothing; start-up
warm-up passes) leaves copies nobody waited for, and the host may run a whole pass ahead of the
device: overwriting the buffer then would hand a queued copy the next step's values. Such a
reset fences the buffer with an event and switches to a second one; it waits only when it comes
back to a buffer whose fence (set a reset earlier) the device has not passed yet.

While the host waits for the sampled tokens, `readback` can hand the time to a callback
(`while_waiting`): the engine uses it to take in requests that arrived during the step and to
start their adapters' copies on the load stream, instead of at the next step boundary.

On CPU the same calls build plain tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

_ALIGN = 16
POLL_S = 1e-4  # how often a waiting readback checks its event between `while_waiting` calls


class HostStaging:
    def __init__(self, device: torch.device, capacity_bytes: int = 1 << 22) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        if self.on_cuda:
            self._buffers = [torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True)
                             for _ in range(2)]
            self._out = torch.empty(1 << 16, dtype=torch.int64, pin_memory=True)
            self._done = torch.cuda.Event()
        self._side = 0  # the buffer this step writes
        self._fences: list[list[torch.cuda.Event]] = [[], []]  # per buffer, see `reset`
        self._offset = 0
        # streams that copies from the current buffer went to since the last wait for them
        self._unwaited: dict[int, torch.cuda.Stream] = {}

    @property
    def _host(self) -> torch.Tensor:
        return self._buffers[self._side]

    def reset(self) -> None:
        """Start a new step. After a `readback` the same buffer is reused at no cost. Otherwise
        its copies are fenced (an event per stream) and the step writes the other buffer, first
        waiting for that buffer's own fence if it has one (normally passed long ago)."""
        if self._unwaited:
            fences = []
            for stream in self._unwaited.values():
                fence = torch.cuda.Event()
                fence.record(stream)
                fences.append(fence)
            self._fences[self._side] = fences
            self._unwaited.clear()
            self._side ^= 1
            for fence in self._fences[self._side]:
                fence.synchronize()  # the device is two unwaited steps behind: let it catch up
            self._fences[self._side] = []
        self._offset = 0

    def tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor holding `values` (a list or a CPU tensor)."""
        src = torch.as_tensor(values, dtype=dtype)
        if not self.on_cuda:
            return src.clone() if isinstance(values, torch.Tensor) else src
        nbytes = src.numel() * src.element_size()
        start = self._offset
        end = start + nbytes
        if end > self._host.numel():
            # Rare: a step larger than the buffer. Grow it; the old buffer's copies already ran
            # (the previous step waited on its event) or are enqueued before any reuse.
            self._buffers[self._side] = torch.empty(
                max(2 * self._host.numel(), end), dtype=torch.uint8, pin_memory=True
            )
        self._offset = -(-end // _ALIGN) * _ALIGN
        staged = self._host[start:end].view(dtype).view(src.shape)
        staged.copy_(src)
        stream = torch.cuda.current_stream(self.device)
        self._unwaited[stream.cuda_stream] = stream
        return staged.to(self.device, non_blocking=True)

    def copy_into(self, dst: torch.Tensor, values, dtype: torch.dtype) -> None:
        """Fill the device tensor `dst` (a static buffer, e.g. a CUDA-graph input) with
        `values`, without a blocking copy."""
        dst.copy_(self.tensor(values, dtype).view(dst.shape), non_blocking=True)

    def readback(
        self, tokens: torch.Tensor, while_waiting: Callable[[], bool] | None = None
    ) -> list[int]:
        """The sampled token ids on the host. Waits on an event, never on the whole device.
        `while_waiting()` runs once the copy is enqueued, then every POLL_S until the tokens are
        in for as long as it returns True (it returns False to wait without polling)."""
        if not self.on_cuda:
            if while_waiting is not None:
                while_waiting()
            return tokens.tolist()
        n = tokens.numel()
        if n > self._out.numel():
            self._out = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
        out = self._out[:n]
        out.copy_(tokens, non_blocking=True)
        stream = torch.cuda.current_stream(self.device)
        self._done.record(stream)
        if while_waiting is not None and while_waiting():
            while not self._done.query():  # a query, not a wait
                time.sleep(POLL_S)
                if not while_waiting():
                    break
        self._done.synchronize()  # the step's single wait: its sampled tokens are in `out`
        self._unwaited.pop(stream.cuda_stream, None)  # and this stream's copies have run
        return out.tolist()
