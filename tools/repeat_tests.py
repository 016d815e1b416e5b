"""Run tests many times to catch a flaky one before CI does.

    python -m tools.repeat_tests -n 50 tests/app/test_adapter_lifecycle.py [pytest args...]
    python -m tools.repeat_tests -n 10 --fresh-clone

Each run is a new pytest process. With test paths, they run alone (no xdist: `-n0`); with
`--fresh-clone`, each run is the README's test command (`python -m pytest`) in a new `git clone`
of this checkout's HEAD with an empty `HOME` and an empty Triton cache, as CI and a new machine
have them. Prints one line per run (pass or the failed tests) and the counts at the end; exits 1
if any run failed. `--out FILE` also writes the counts and each run's failures as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def run_once(pytest_args: list[str], fresh_clone: bool) -> tuple[bool, list[str], float, str]:
    """One pytest process: (passed, the failed test ids, seconds, its output)."""
    with tempfile.TemporaryDirectory(prefix="repeat-") as scratch:
        env = dict(os.environ)
        cwd = ROOT
        if fresh_clone:
            cwd = Path(scratch) / "checkout"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(cwd)], check=True)
            env["HOME"] = str(Path(scratch) / "home")
            env["TRITON_CACHE_DIR"] = str(Path(scratch) / "triton")
            Path(env["HOME"]).mkdir()
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    failed = FAILED_LINE.findall(output)
    if done.returncode != 0 and not failed:  # a crash, a collection error, an internal error
        failed = [f"exit status {done.returncode}: {output.strip().splitlines()[-1:]}"]
    return done.returncode == 0, failed, seconds, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--runs", type=int, default=20, help="how many runs")
    parser.add_argument(
        "--fresh-clone",
        action="store_true",
        help="each run: the whole suite in a new clone of HEAD, with an empty HOME",
    )
    parser.add_argument("--out", type=Path, help="write the counts as JSON here")
    args, pytest_args = parser.parse_known_args(argv)
    if not args.fresh_clone and not pytest_args:
        parser.error("name the tests to repeat, or pass --fresh-clone for the whole suite")
    if not args.fresh_clone and "-n" not in pytest_args:
        pytest_args = ["-n0", *pytest_args]
    runs = []
    for i in range(args.runs):
        passed, failed, seconds, output = run_once(pytest_args, args.fresh_clone)
        runs.append({"passed": passed, "failed": failed, "seconds": round(seconds, 1)})
        if not passed:  # a rare failure is worth its whole output: which assertion, what values
            log = Path(tempfile.gettempdir()) / f"repeat-tests-{os.getpid()}-run{i + 1}.log"
            log.write_text(output)
            failed = [*failed, f"output: {log}"]
        print(
            f"run {i + 1}/{args.runs}: {'pass' if passed else 'FAIL'} in {seconds:.0f} s"
            + "".join(f"\n  {test}" for test in failed),
            flush=True,
        )
    failures = sum(not r["passed"] for r in runs)
    print(f"{len(runs) - failures} of {len(runs)} runs passed")
    if args.out is not None:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        args.out.write_text(
            json.dumps(
                {
                    "command": " ".join(["python -m tools.repeat_tests", *(argv or sys.argv[1:])]),
                    "commit": commit,
                    "date": datetime.date.today().isoformat(),
                    "runs": len(runs),
                    "failed_runs": failures,
                    "each": runs,
                },
                indent=1,
            )
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
