"""Adapter loading modes, chosen once by name (`EngineConfig.adapter_loading`). Plain Python.

- "blocking": a request's adapter is read and copied while the step waits (the simple baseline).
- "overlap": disk reads run on the read pool and host->GPU copies on the load stream, while
  requests whose adapters are ready keep running; nothing is loaded before it is needed.
- "prefetch": as "overlap", plus the prefetch queue, fed by the waiting queue and by hints from
  outside the engine, loads soonest-needed adapters into free or reclaimable slots ahead of
  admission, between steps and while a step runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadingMode:
    name: str
    background_reads: bool  # disk reads on the read pool; else `prepare` reads while it waits
    load_stream: bool  # copies on the load stream; else on the compute stream, ahead of the step
    prefetch: bool  # the prefetch queue starts loads ahead of admission (and mid-step)


LOADING_MODES: dict[str, LoadingMode] = {
    mode.name: mode
    for mode in (
        LoadingMode("blocking", background_reads=False, load_stream=False, prefetch=False),
        LoadingMode("overlap", background_reads=True, load_stream=True, prefetch=False),
        LoadingMode("prefetch", background_reads=True, load_stream=True, prefetch=True),
    )
}


def loading_mode(name: str) -> LoadingMode:
    """The mode called `name`. Raises ValueError for an unknown name."""
    mode = LOADING_MODES.get(name)
    if mode is None:
        raise ValueError(
            f"adapter loading mode must be one of {tuple(LOADING_MODES)}, got {name!r}"
        )
    return mode
