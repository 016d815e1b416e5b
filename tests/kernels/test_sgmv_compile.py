"""Every SGMV tuning row compiles for Hopper (sm_90) down to the cubin, on a machine without a
GPU (`tools/aot.py`): bf16 and float32, with and without programmatic dependent launch.

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


needs_nvidia_tools = pytest.mark.skipif(not _nvidia_tools(),
                                        reason="Triton's NVIDIA backend tools are missing")


def compile_rows(*args: str) -> list[str]:
    """`python -m tools.aot` with `args`: one line per compiled kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "tools.aot", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return [ln for ln in run.stdout.splitlines() if ln.startswith(("shrink", "expand"))]


def usage_field(line: str, name: str) -> int:
    return int(re.search(rf"{name} +(\d+)", line).group(1))


# (dtype, PDL, groups): the serving kernels (bf16 under PDL) for the narrowest and the widest
# hidden size; the other settings over the widest, where registers run out first. One setting a
# test, so that test workers share the compiles.
SETTINGS = [("bfloat16", "on", "qkv,down"), ("bfloat16", "off", "down"),
            ("float32", "on", "down"), ("float32", "off", "down")]


@needs_nvidia_tools
@pytest.mark.parametrize("dtype, pdl, groups", SETTINGS)
def test_every_tuning_row_compiles_for_hopper(dtype, pdl, groups):
    lines = compile_rows("--groups", groups, "--dtypes", dtype, "--pdl", pdl)
    run_stdout = "\n".join(lines)
    from tools.aot import MAX_RANKS, kernel_variants, table_token_counts

    # kernels (and one-token variants) x token count x pool rank, x group
    kernels = sum(len(kernel_variants(n, r)) for n in table_token_counts() for r in MAX_RANKS)
    assert len(lines) == kernels * len(groups.split(",")), run_stdout
    assert all(f" {dtype} " in line and f"pdl {pdl == 'on'!s:5}" in line for line in lines)
    assert any("segments one-token" in line for line in lines), run_stdout
    for line in lines:
        assert 0 < usage_field(line, "regs") <= 255, line
