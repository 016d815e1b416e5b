"""Adapter weights on the device: one buffer per layer and projection group, indexed by slot.

Groups share an input, so one shrink serves the whole group (see kernels/sgmv.py):
    qkv:     q_proj, k_proj, v_proj     A [S, 3R, hidden]       B [S, R, q+2kv]
    o:       o_proj                     A [S, R, q]             B [S, R, hidden]
    gate_up: gate_proj, up_proj         A [S, 2R, hidden]       B [S, R, 2*inter]
    down:    down_proj                  A [S, R, inter]         B [S, R, hidden]
B is rank-major: each rank index one row over the group's output columns, so the expand reads a
slot's rank rows whole, whatever the pool's max rank. In a slot, every group's A comes first,
then one [R, sum of all groups' widths] matrix whose column ranges are the groups' B.
A projection an adapter does not target stays zero in its slot, so it adds nothing. The pool
owns the buffers; `write` fills a slot that no running request uses (the slot pool guarantees it).
"""

from __future__ import annotations

import contextlib

import torch

from kernels.sgmv import SgmvBatch, get_backend
from kernels.sgmv_tuning import DEFAULT_TUNING, SgmvTuning
from replicas.adapters.host_threads import parallel
from replicas.adapters.loader import AdapterFile, AdapterWeights
from replicas.models.spec import ModelSpec

LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


PACK_OVERHEAD = 1.25  # pack an adapter per layer only if zeros add at most this much host memory


def _region(buf: torch.Tensor, offset: int, shape: tuple[int, int]) -> torch.Tensor:
    """[num_slots, *shape] view of columns offset.. of a [num_slots, slot_elems] buffer."""
    return buf[:, offset : offset + shape[0] * shape[1]].view(buf.shape[0], *shape)


class LoraWeightPool:
    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str = "torch",
        tuning: SgmvTuning = DEFAULT_TUNING,
    ) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.backend = backend
        self.tuning = tuning  # the SGMV kernels' block sizes and launch switches
        self.sgmv = get_backend(backend, tuning)
        self.dtype = dtype
        # One buffer per layer, [num_slots, slot_elems]: a slot's weights for a layer are one
        # contiguous run: every group's A, then B of all groups as one [R, width] matrix, rank-major
        # (the groups' B are its column ranges). An adapter packed on the host (`pack`: the
        # slot's image per layer) reaches its slot in one copy per layer. The group tensors are
        # views.
        self.out_offsets: dict[str, tuple[int, ...]] = {}
        self.a_regions: dict[str, tuple[int, tuple[int, int]]] = {}  # offset, [n*R, in]
        self.b_columns: dict[str, tuple[int, int]] = {}  # the group's columns of the B matrix
        offset, width = 0, 0
        for group, targets in LORA_GROUPS.items():
            d_in = spec.lora_dims(targets[0])[0]
            outs = [spec.lora_dims(t)[1] for t in targets]
            offsets = [0]
            for o in outs:
                offsets.append(offsets[-1] + o)
            self.out_offsets[group] = tuple(offsets)
            self.a_regions[group] = (offset, (len(targets) * max_rank, d_in))
            offset += len(targets) * max_rank * d_in
            self.b_columns[group] = (width, width + offsets[-1])
            width += offsets[-1]
        self.a_elems, self.b_width = offset, width
        self.slot_elems = offset + max_rank * width
        self.layers = [
            torch.zeros(num_slots, self.slot_elems, dtype=dtype, device=device)
            for _ in range(spec.num_layers)
        ]
        self.a: list[dict[str, torch.Tensor]] = []  # [S, n*R, in] per group
        self.b_all = [_region(buf, offset, (max_rank, width)) for buf in self.layers]  # [S, R, W]
        self.b: list[dict[str, torch.Tensor]] = []  # [S, R, sum(out)] per group: column views
        for buf, b_all in zip(self.layers, self.b_all, strict=True):
            self.a.append({g: _region(buf, a_off, a_shape)
                           for g, (a_off, a_shape) in self.a_regions.items()})
            self.b.append({g: b_all[:, :, c0:c1] for g, (c0, c1) in self.b_columns.items()})
        self._layer_bytes = [buf.view(torch.uint8) for buf in self.layers]  # for packed writes
        self._slot_bytes = self._layer_bytes[0].shape[1]
        # The largest module's A or B: `_pack` slices its zero fillers from these bytes.
        largest = max_rank * max(max(spec.lora_dims(t)) for ts in LORA_GROUPS.values() for t in ts)
        self._zero_bytes = torch.zeros(largest * self.layers[0].element_size(), dtype=torch.uint8)
        self.ranks_host = [0] * num_slots
        self.scalings_host = [0.0] * num_slots
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.scalings = torch.zeros(num_slots, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.layers)

    def pack(self, weights: AdapterWeights) -> AdapterWeights:
        """The adapter in pinned host memory, ready for `write`. When every module has the pool's
        max rank and the slot layout wastes little (untargeted projections are zeros in it), the
        weights are packed into one buffer per layer holding the slot's image; a write then
        crosses in one copy per layer at the full host->device bandwidth, instead of two copies
        and a transpose per module."""
        if weights.layers is not None:
            return weights
        if weights.modules and all(a.dtype == self.dtype for a, _ in weights.modules.values()):
            parts = {key: (a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                     for key, (a, b) in weights.modules.items()}
            packed = self._pack(weights.name, weights.rank, weights.scaling, parts,
                                [a.shape[0] for a, _ in weights.modules.values()])
            if packed is not None:
                return packed
        return weights.pinned() if self.device.type == "cuda" else weights

    def pack_file(self, file: AdapterFile) -> AdapterWeights:
        """`pack` straight from the file's bytes: when the file's dtype is the pool's and no
        module has its own scaling, the packed buffers are filled by one copy, with no torch op
        per module (this runs on a reader thread; see AdapterFile)."""
        if not file.ratios and file.dtype == self.dtype:
            raw = file.raw
            parts = {key: (raw[a.start : a.end], raw[b.start : b.end])  # indexing: no GIL release
                     for key, (a, b) in file.pairs.items()}
            packed = self._pack(file.name, file.rank, file.config.scaling(), parts,
                                [a.shape[0] for a, _ in file.pairs.values()])
            if packed is not None:
                return packed
        return self.pack(file.to_weights(self.dtype))

    def _pack(self, name: str, rank: int, scaling: float,
              parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
              ranks: list[int]) -> AdapterWeights | None:
        """Pinned buffers, one per layer, each the slot's image: every group's A, then the
        rank-major B matrix [R, width]. From `parts` (uint8 A and B per module, as in the file)
        and zeros, three torch ops a layer: one `torch.cat` of the A runs, one of the B blocks in
        the file's order ([width, R]) and one transpose into place (about 4 ms a layer at rank
        128 on one core), the layers spread over the host threads, off the step loop. None when
        packing does not pay."""
        elem = self.layers[0].element_size()
        packed_bytes = self.spec.num_layers * self.slot_elems * elem
        given = sum(a.numel() + b.numel() for a, b in parts.values())
        if any(r != self.max_rank for r in ranks) or packed_bytes > PACK_OVERHEAD * given:
            return None
        zeros = self._zero_bytes
        R = self.max_rank
        order = []
        for layer in range(self.spec.num_layers):
            for side in (0, 1):  # every group's A, then every group's B ([out, R] as in the file)
                for group, targets in LORA_GROUPS.items():
                    d_in = self.a_regions[group][1][1]
                    offsets = self.out_offsets[group]
                    for i, target in enumerate(targets):
                        pair = parts.get((layer, target))
                        if pair is not None:
                            order.append(pair[side])
                            continue
                        n = R * d_in if side == 0 else (offsets[i + 1] - offsets[i]) * R
                        order.append(zeros[: n * elem])
        # One buffer per layer: the host cache frees and reuses them as adapters come and go,
        # and pinned blocks of a layer's size are cheap to find again.
        pin = self.device.type == "cuda"
        per_layer = len(order) // self.spec.num_layers
        num_a = sum(len(targets) for targets in LORA_GROUPS.values())  # A chunks lead a layer
        a_bytes = self.a_elems * elem

        def pack_layer(layer: int) -> torch.Tensor:  # on a host thread (torch releases the GIL)
            chunks = order[layer * per_layer : (layer + 1) * per_layer]
            buf = torch.empty(self.slot_elems * elem, dtype=torch.uint8, pin_memory=pin)
            b_file = torch.empty(self.b_width, R, dtype=self.dtype)  # the layer's B as in the file
            torch.cat(chunks[:num_a], out=buf[:a_bytes])
            torch.cat(chunks[num_a:], out=b_file.view(-1).view(torch.uint8))
            buf[a_bytes:].view(self.dtype).view(R, self.b_width).copy_(b_file.t())
            return buf

        layers = parallel(pack_layer, range(self.spec.num_layers))
        return AdapterWeights(name, rank, scaling, {}, tuple(layers))

    def write(
        self, slot: int, weights: AdapterWeights, stream: torch.cuda.Stream | None = None
    ) -> list[torch.cuda.Event] | None:
        """Copy an adapter into `slot`, replacing whatever was there.

        On CUDA with a `stream`, the copies are enqueued there (non-blocking, from pinned host
        memory) layer by layer, and one event per layer is returned: the forward pass of layer L
        waits on event L only, so a prefill can start while later layers are still arriving. The
        caller orders the stream after any work that still reads the slot's previous adapter.
        Without a stream the copies run on the current stream.
        """
        R = self.max_rank
        prev = self.ranks_host[slot]  # rows/columns past `prev` are zero in every module
        events: list[torch.cuda.Event] | None = [] if stream is not None else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            _set_element(self.ranks, slot, weights.rank)
            _set_element(self.scalings, slot, weights.scaling)
            packed = weights.layers
            if packed is not None and packed[0].numel() != self._slot_bytes:
                packed = None
            for layer in range(self.spec.num_layers):
                if packed is not None:  # the slot's image, zeros past each module's rank: one copy
                    self._layer_bytes[layer][slot].copy_(packed[layer], non_blocking=True)
                    if events is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                        events.append(event)
                    continue
                for group, targets in LORA_GROUPS.items():
                    a, b = self.a[layer][group][slot], self.b[layer][group][slot]
                    offsets = self.out_offsets[group]
                    for i, target in enumerate(targets):
                        rows, cols = a[i * R : (i + 1) * R], b[:, offsets[i] : offsets[i + 1]]
                        pair = weights.modules.get((layer, target))
                        r = 0 if pair is None else pair[0].shape[0]
                        if pair is not None:
                            rows[:r].copy_(pair[0], non_blocking=True)
                            _copy_transposed(cols[:r], pair[1])
                        if prev > r:
                            rows[r:prev].zero_()
                            cols[r:prev].zero_()
                if events is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                    events.append(event)
        self.ranks_host[slot] = weights.rank
        self.scalings_host[slot] = weights.scaling
        return events

    def make_batch(
        self, seg_lens: list[int], seg_slots: list[int], num_tokens: int, to_device=None
    ) -> SgmvBatch:
        """Segments laid end to end from token 0 (the runner puts adapter tokens first, grouped by
        slot, and base-model tokens after them). `to_device(values, dtype)` moves the segment
        tables to the device (the runner passes its non-blocking staging)."""
        starts, ends, pos = [], [], 0
        for n in seg_lens:
            starts.append(pos)
            pos += n
            ends.append(pos)
        if to_device is None:
            to_device = lambda values, dtype: torch.tensor(values, dtype=dtype).to(self.device)
        return SgmvBatch(
            seg_starts=starts,
            seg_ends=ends,
            seg_slots_host=list(seg_slots),
            seg_indptr=to_device([0, *ends], torch.int32),
            seg_slots=to_device(list(seg_slots), torch.int32),
            slot_ranks=self.ranks,
            slot_scalings=self.scalings,
            slot_ranks_host=tuple(self.ranks_host),
            slot_scalings_host=tuple(self.scalings_host),
            num_tokens=num_tokens,
        )

    def apply(
        self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, batch: SgmvBatch
    ) -> None:
        """y [T, sum(out)] += LoRA delta of `group` for the tokens in `batch`'s segments."""
        if batch.empty:
            return
        self.sgmv.apply(
            x, self.a[layer][group], self.b[layer][group], batch, y, self.out_offsets[group]
        )


def _copy_transposed(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst [r, out] = src [out, r]^T. From host memory to a GPU the bytes cross as they are
    (non-blocking from pinned memory into a buffer on the current stream, which the allocator
    keeps until that stream has used it) and the transpose runs on the device: a strided source
    on the host would go through pageable memory, a blocking copy."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        src = src.to(dst.device, non_blocking=True)
    dst.copy_(src.t())


def _set_element(dst: torch.Tensor, index: int, value: float) -> None:
    """dst[index] = value on the current stream, without a blocking copy. On CUDA a plain
    assignment copies from pageable memory and waits; here the value goes through a fresh pinned
    tensor, which the caching host allocator keeps until the copy has run."""
    if dst.device.type != "cuda":
        dst[index] = value
        return
    src = torch.tensor([value], dtype=dst.dtype).pin_memory()
    dst[index : index + 1].copy_(src, non_blocking=True)
