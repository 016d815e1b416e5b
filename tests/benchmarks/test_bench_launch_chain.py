"""The launch-chain benchmark's kernel: each link adds its weight block's sum to the row the link
before it wrote, so a layer's last row holds the sum over all eight links' blocks."""

import torch

from benchmarks.bench_launch_chain import LAUNCHES, ROW, Chain


def test_a_layer_chains_every_link():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    programs = 3
    chain = Chain(programs=programs, weight_kb=1, pdl=False, device=device, layers=2)
    for layer in range(2):
        chain.layer(layer)
    blocks = chain.weights.float().view(2 * LAUNCHES, programs, -1).sum(dim=2)  # [link, program]
    # every program reads program 0's row of the link before: the chain runs through program 0
    through_0 = blocks[:, 0].cumsum(dim=0)
    last = chain.rows[(2 * LAUNCHES) % 2].view(programs, ROW).cpu()
    for p in range(programs):
        want = through_0[-2] + blocks[-1, p]
        assert torch.allclose(last[p], want.cpu().expand(ROW), rtol=1e-4, atol=1e-3)


def test_a_heavy_link_alone_reads_weights():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chain = Chain(programs=2, weight_kb=1, pdl=False, device=device, layers=1, heavy_link=2)
    chain.layer(0)
    blocks = chain.weights.float().view(LAUNCHES, 2, -1).sum(dim=2)
    last = chain.rows[LAUNCHES % 2].view(2, ROW).cpu()
    assert torch.allclose(last, blocks[2, 0].cpu().expand(2, ROW), rtol=1e-4, atol=1e-3)
