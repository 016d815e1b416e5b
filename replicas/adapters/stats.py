"""The adapter tiers' counters, shared by the parts that count (reader, uploader, manager)."""

from __future__ import annotations

from dataclasses import dataclass, field

READ_SECONDS_KEPT = 256  # recent disk read latencies kept in `read_seconds`


@dataclass
class AdapterStats:
    disk_reads: int = 0  # disk -> host
    gpu_loads: int = 0  # host -> GPU slot
    prefetch_loads: int = 0  # GPU loads started by the prefetcher, ahead of admission
    hits: int = 0  # admissions that found the adapter already in a slot
    misses: int = 0  # admissions that had to bring it in
    read_seconds: list[float] = field(default_factory=list)  # recent disk read latencies

    def record_read(self, seconds: float) -> None:
        self.read_seconds.append(seconds)
        del self.read_seconds[:-READ_SECONDS_KEPT]
