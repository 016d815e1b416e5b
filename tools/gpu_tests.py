"""Run the GPU tests on a GPU machine and record the outcome of each.

    python -m tools.gpu_tests --commit <sha> [--out benchmarks/results] [pytest args...]

Runs every GPU-marked test (`pytest tests/gpu tests/kernels -m gpu`, or the arguments given)
without pytest-xdist, then writes `gpu_tests.md` and `gpu_tests.json` under `--out`: the date,
the commit, the device, and passed / failed / skipped for every test. The exit status is
pytest's. `--commit` names the tree the tests ran on (a GPU machine may get the working tree
without its git history).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_ARGS = ["tests/gpu", "tests/kernels", "-m", "gpu"]


def outcomes(junit_xml: Path) -> list[dict[str, str]]:
    """One row per test case of a JUnit XML report: its id and passed / failed / skipped."""
    rows = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        test = f"{test_path(case.get('classname', ''), case.get('file'))}::{case.get('name')}"
        rows.append({"test": test, "outcome": outcome, "time_s": case.get("time", "")})
    return rows


def test_path(classname: str, file: str | None) -> str:
    """A test's file and class as pytest names them: `tests/kernels/test_sgmv.py::TestOnGpu`
    from the report's dotted `classname` and its `file` (xunit1 reports carry it)."""
    if file is None:
        return classname.replace(".", "/") + ".py"
    module = file.removesuffix(".py").replace("/", ".")
    inner = classname.removeprefix(module).lstrip(".")
    return f"{file}::{inner.replace('.', '::')}" if inner else file


def with_default_paths(pytest_args: list[str]) -> list[str]:
    """`pytest_args`, after the default paths and marker when it names no test path."""
    if any(Path(arg.split("::")[0]).exists() for arg in pytest_args):
        return pytest_args
    return [*DEFAULT_ARGS, *pytest_args]


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"


def write(out: Path, rows: list[dict[str, str]], meta: dict[str, str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "skipped")}
    (out / "gpu_tests.json").write_text(json.dumps({**meta, **counts, "tests": rows}, indent=1))
    lines = ["# GPU tests", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    lines += [
        f"- {', '.join(f'{v} {k}' for k, v in counts.items())}",
        "",
        "| test | outcome | s |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{r['test']}` | {r['outcome']} | {r['time_s']} |" for r in rows]
    path = out / "gpu_tests.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True, help="the commit the working tree is at")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args, pytest_args = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
            "-q",
            "-o",
            "junit_family=xunit1",  # each case names its file
            f"--junitxml={junit}",
            *with_default_paths(pytest_args),
        ]
        rc = subprocess.call(command)
        if not junit.exists():
            return rc or 1
        rows = outcomes(junit)
    meta = {
        "command": "python -m tools.gpu_tests " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "device": device_name(),
    }
    print(f"wrote {write(args.out, rows, meta)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
