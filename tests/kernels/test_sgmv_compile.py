"""Every SGMV tuning row compiles for Hopper (sm_90) down to the cubin, on a machine without a
GPU (`kernels/aot.py`): bf16 and float32, with and without programmatic dependent launch.

The CPU tests run the kernels in Triton's interpreter, which accepts programs the compiler
refuses (an `if` whose branches give one name two shapes, for one). Run in a subprocess, since
the interpreter, once selected by another test module, replaces the compiled kernels.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nvidia_tools() -> bool:
    try:
        import triton
    except ImportError:
        return False
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (bin_dir / "ptxas").exists() and (bin_dir / "cuobjdump").exists()


@pytest.mark.skipif(not _nvidia_tools(), reason="Triton's NVIDIA backend tools are missing")
def test_every_tuning_row_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "kernels.aot", "--groups", "qkv,down"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(("shrink", "expand"))]
    from kernels.aot import MAX_RANKS, kernel_variants, table_token_counts

    # kernels (and one-token variants) x token count x pool rank, x dtype x PDL x group
    kernels = sum(len(kernel_variants(n, r)) for n in table_token_counts() for r in MAX_RANKS)
    assert len(lines) == kernels * 2 * 2 * 2, run.stdout
    assert any("segments one-token" in line for line in lines), run.stdout
    for line in lines:
        regs = int(re.search(r"regs +(\d+)", line).group(1))
        assert 0 < regs <= 255, line
