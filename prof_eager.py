import cProfile
import io
import os
import pstats
import sys
import time

import torch

import benchmarks.bench_decode_step as b

orig = b.time_cuda
out = os.environ.get("OUT", "/tmp")


def prof_time(fn, **kw):
    us = orig(fn, **kw)
    if fn.__name__ == "eager":
        label = "adapters" if fn.__defaults__[0] else "base"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"{label}: host issue {1e3 * (t1 - t0) / 10:.2f} ms/step, with sync "
              f"{1e3 * (t2 - t0) / 10:.2f}; time_cuda {us / 1e3:.2f}", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        pr.disable()
        for key in ("tottime", "cumtime"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
            open(f"{out}/prof_{label}_{key}.txt", "w").write(s.getvalue())
    return us


b.time_cuda = prof_time
sys.argv = ["bench_decode_step", "--triton-only", "--out", out]
b.main()
