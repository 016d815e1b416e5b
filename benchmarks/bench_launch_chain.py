"""The latency floor of a LoRA layer at small batches: a chain of eight dependent launches.

    python -m benchmarks.bench_launch_chain [--out DIR]
    python -m benchmarks.bench_launch_chain --smoke    # CPU, Triton's interpreter: plumbing only

A layer's LoRA work is four shrink + expand pairs, each kernel reading what the one before it
wrote. At one to eight tokens the weights are 1-21 MB (0.3-7 µs at HBM bandwidth), so the
chain's own latency weighs as much as the bytes. This measures the chain with kernels that do
almost nothing, shaped as the SGMV kernels are: each program may read a block of weights before
it waits for the kernel before (programmatic dependent launch), then reads a row that kernel
wrote and writes a row of its own. Eight launches a layer, captured in one CUDA graph over 32
layers (the weight blocks rotate past L2), with and without PDL, over grid sizes; then, in the
same run, the SGMV layer at the small-batch cells (`bench_sgmv`'s cases) against the chain at
one program per SM and against the bandwidth floor.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_sgmv import (
    LLAMA3_8B,
    MIXED_RANKS,
    Case,
    graph_us_per_layer,
    layers_for,
    make_problem,
    minimal_bytes,
    sgmv_layer,
)

LAUNCHES = 8  # per layer: four shrink + expand pairs
LAYERS = 32
GRIDS = (1, 16, 132, 264, 528, 1056)  # programs per launch (132: one per H100 SM)
WEIGHT_KB = (8, 32)  # per program, read before the wait, at one program per SM
HEAVY_KB, HEAVY_LINK = (32, 64), 3  # ... or by one link of each layer alone
CELLS = [  # the small-batch cells: B tokens over D adapters
    Case("decode", (1,), (8,), "8"),
    Case("decode", (1,), (16,), "16"),
    Case("decode", (1,), (64,), "64"),
    Case("decode", (8,), (8,), "8"),
    Case("decode", (8,), (16,), "16"),
    Case("decode", (8,), (64,), "64"),
    Case("decode", (1,) * 8, (8,) * 8, "8"),
    Case("decode", (1,) * 8, (16,) * 8, "16"),
    Case("decode", (1,) * 8, (64,) * 8, "64"),
    Case("decode", (1,) * 8, tuple(MIXED_RANKS[i % 4] for i in range(8)), "mixed"),
]
ROW = 128  # float32 elements each program reads from the kernel before and writes


def _kernel():
    import triton
    import triton.language as tl

    from kernels.sgmv_triton import gdc_launch_dependents, gdc_wait

    @triton.jit
    def link(w_ptr, in_ptr, out_ptr, W: tl.constexpr, N: tl.constexpr, PDL: tl.constexpr):
        """One link of the chain: the weight block first (before the wait, as an SGMV item),
        then the previous kernel's row, then this program's row."""
        pid = tl.program_id(0)
        if PDL:
            gdc_launch_dependents()
        v = tl.zeros((N,), dtype=tl.float32)
        if W > 0:
            w = tl.load(w_ptr + pid.to(tl.int64) * W + tl.arange(0, W),
                        eviction_policy="evict_first")
            v += tl.sum(w.to(tl.float32), axis=0)
        if PDL:
            gdc_wait()
        v += tl.load(in_ptr + tl.arange(0, N))
        tl.store(out_ptr + pid * N + tl.arange(0, N), v)

    return link


class Chain:
    """`LAUNCHES` dependent launches of `link` per layer over `programs` programs, each reading
    `weight_kb` KB of its own weights (a fresh block every launch of every layer); with
    `heavy_link`, only that link of each layer reads weights."""

    def __init__(self, programs: int, weight_kb: int, pdl: bool, device, layers: int = LAYERS,
                 heavy_link: int | None = None):
        self.link, self.programs, self.pdl, self.layers = _kernel(), programs, pdl, layers
        self.heavy_link = heavy_link
        self.w_elems = weight_kb * 512  # bf16
        blocks = layers * LAUNCHES if weight_kb else 1
        self.weights = torch.randn(blocks, programs * max(self.w_elems, 1), device=device,
                                   dtype=torch.bfloat16)
        self.rows = [torch.zeros(programs * ROW, device=device) for _ in range(2)]

    def layer(self, layer: int) -> None:
        for i in range(LAUNCHES):
            w = self.weights[(layer * LAUNCHES + i) % self.weights.shape[0]]
            w_elems = self.w_elems if self.heavy_link in (None, i) else 0
            self.link[(self.programs,)](w, self.rows[i % 2], self.rows[(i + 1) % 2],
                                        w_elems, ROW, self.pdl,
                                        **({"launch_pdl": True} if self.pdl else {}))

    def us_per_layer(self) -> float:
        from benchmarks.common import graph_replay_us

        def step():
            for layer in range(self.layers):
                self.layer(layer)

        return graph_replay_us(step) / self.layers


def run_gpu(args: argparse.Namespace) -> None:
    from benchmarks.common import hbm_bandwidth, write_results
    from kernels.sgmv_triton import pdl_supported

    device = torch.device("cuda")
    if not pdl_supported(device):
        raise SystemExit("needs programmatic dependent launch (Hopper or later, a Triton with "
                         "launch_pdl): the chain it measures is the SGMV kernels'")
    bw = hbm_bandwidth()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"HBM copy bandwidth: {bw / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    rows = []
    for programs in GRIDS:
        for pdl in (True, False):
            us = Chain(programs, 0, pdl, device).us_per_layer()
            rows.append({"what": "chain", "programs": programs, "pdl": pdl, "weight_KB": 0,
                         "us_per_layer": us})
            print(rows[-1], flush=True)
    floor = next(r["us_per_layer"] for r in rows if r["programs"] == sms and r["pdl"])
    for kb in WEIGHT_KB:
        us = Chain(sms, kb, True, device).us_per_layer()
        bw_us = LAUNCHES * sms * kb * 1024 / bw * 1e6
        rows.append({"what": "chain + weights", "programs": sms, "pdl": True, "weight_KB": kb,
                     "us_per_layer": us, "chain_floor_us": floor, "bw_floor_us": bw_us,
                     "vs_floor": us / max(floor, bw_us)})
        print(rows[-1], flush=True)
    # One heavy link in eight: its read, issued before its wait, overlaps the links before it
    # (more than the one just before) when the layer costs less than chain + its bytes.
    for kb in HEAVY_KB:
        us = Chain(sms, kb, True, device, heavy_link=HEAVY_LINK).us_per_layer()
        bw_us = sms * kb * 1024 / bw * 1e6
        rows.append({"what": f"chain + weights at link {HEAVY_LINK} only", "programs": sms,
                     "pdl": True, "weight_KB": kb, "us_per_layer": us, "chain_floor_us": floor,
                     "bw_floor_us": bw_us, "vs_floor": us / max(floor, bw_us)})
        print(rows[-1], flush=True)
    for case in CELLS:
        layers = layers_for(case, LLAMA3_8B, device)
        p = make_problem(case, LLAMA3_8B, layers, torch.bfloat16, device)
        us = graph_us_per_layer(p, sgmv_layer)
        bw_us = minimal_bytes(case, LLAMA3_8B) / bw * 1e6
        rows.append({"what": f"sgmv B={case.num_tokens} D={case.num_adapters} r{case.rank_label}",
                     "us_per_layer": us, "chain_floor_us": floor, "bw_floor_us": bw_us,
                     "vs_floor": us / max(floor, bw_us)})
        print(rows[-1], flush=True)
        del p
        torch.cuda.empty_cache()
    path = write_results(
        args.out, "launch_chain",
        "Eight dependent launches a layer: the small-batch latency floor (CUDA-graph replay)",
        f"µs per layer of {LAUNCHES} dependent launches of a minimal kernel (read a weight block "
        "before the wait, the previous kernel's row after it, write a row), over grid sizes, "
        "with and without programmatic dependent launch; then the SGMV layer (all seven "
        "projections, bf16) at B <= 8 in the same run. chain_floor_us = the minimal chain at one "
        "program per SM under PDL; bw_floor_us = minimal bytes / HBM copy bandwidth; vs_floor = "
        "measured / max(chain_floor_us, bw_floor_us)",
        ["what", "programs", "pdl", "weight_KB", "us_per_layer", "chain_floor_us", "bw_floor_us",
         "vs_floor"],
        rows,
        {"hbm_bandwidth_TBps": round(bw / 1e12, 3), "sms": sms, "launches_per_layer": LAUNCHES},
    )
    print(f"wrote {path}")


def run_smoke(args: argparse.Namespace) -> None:
    """The chain's kernel through the interpreter, without PDL: each link adds its weight
    block's sum to the row it read, so after a layer the row holds the sum of all eight."""
    chain = Chain(programs=2, weight_kb=1, pdl=False, device=torch.device("cpu"), layers=1)
    chain.layer(0)
    expected = chain.weights.float().view(LAUNCHES, 2, -1).sum(dim=2)[:, 0].sum()
    got = chain.rows[LAUNCHES % 2][0].item()
    assert abs(got - expected.item()) <= 1e-3 * max(1.0, abs(expected.item())), (got, expected)
    print(f"smoke: a layer's row {got:.4f}, expected {expected.item():.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, no timing")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from benchmarks.common import run_smoke_or_gpu

    run_smoke_or_gpu(args, run_smoke, run_gpu)


if __name__ == "__main__":
    main()
