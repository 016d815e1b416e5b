"""Fleet simulator: the replica's real scheduler, slot pool, host cache, prefetch queue and copy
budget, and the real routing code, driven on a virtual clock, with Ray Serve's request router
modelled rule by rule. Plain Python: no torch, no Ray at run time.

    sim/calibration.py  step, copy and read times (JSON written by `python -m sim.calibrate`)
    sim/events.py       the virtual clock and its event queue
    sim/replica.py      one engine replica from the real parts (`SimReplica`)
    sim/serve.py        Ray Serve's RequestRouter, its pow2 router and ours, the controller
    sim/fleet.py        replicas + routers + workload -> `FleetResult`
    sim/workload.py     request streams (the serving benchmark's, or generated)
    sim/cells.py        the routing cells run on GPUs and their predictions (`python -m sim.cells`)
    sim/bound.py        the fewest loads a router can make: Belady's MIN, A0 if it cannot see ahead
    sim/validate.py     predicted against measured (`python -m sim.validate`)
"""
