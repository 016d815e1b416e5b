"""The GPU test record: each test case of a JUnit report becomes a row with its outcome."""

import ast
import json
from pathlib import Path

from tools.gpu_tests import DEFAULT_ARGS, outcomes, with_default_paths, write

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu.test_a" name="test_ok" time="1.5"/>
<testcase classname="tests.gpu.test_a" name="test_bad[64-64]" time="2.0">
<failure message="assert False">trace</failure></testcase>
<testcase classname="tests.gpu.test_b" name="test_skip" time="0.0">
<skipped message="needs Hopper"/></testcase>
</testsuite></testsuites>
"""


def test_each_case_is_a_row_with_its_outcome_and_the_counts_are_written(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    rows = outcomes(report)
    assert [(r["test"], r["outcome"]) for r in rows] == [
        ("tests/gpu/test_a.py::test_ok", "passed"),
        ("tests/gpu/test_a.py::test_bad[64-64]", "failed"),
        ("tests/gpu/test_b.py::test_skip", "skipped"),
    ]
    meta = {"date": "2026-11-27", "commit": "abc", "device": "NVIDIA H200"}
    md = write(tmp_path / "out", rows, meta).read_text()
    assert "- commit: abc" in md and "- 1 passed, 1 failed, 1 skipped" in md
    assert "| `tests/gpu/test_a.py::test_bad[64-64]` | failed | 2.0 |" in md
    data = json.loads((tmp_path / "out" / "gpu_tests.json").read_text())
    assert (data["passed"], data["failed"], data["skipped"]) == (1, 1, 1)
    assert data["device"] == "NVIDIA H200" and len(data["tests"]) == 3


def test_a_case_in_a_test_class_is_named_by_its_file_and_class(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest" tests="1">'
        '<testcase classname="tests.kernels.test_sgmv.TestOnGpu" name="test_x[b1]" '
        'file="tests/kernels/test_sgmv.py" line="3" time="0.5"/></testsuite></testsuites>'
    )
    assert outcomes(report)[0]["test"] == "tests/kernels/test_sgmv.py::TestOnGpu::test_x[b1]"


def test_flags_alone_run_the_default_paths_and_paths_replace_them():
    assert with_default_paths(["-q", "-x"]) == [*DEFAULT_ARGS, "-q", "-x"]
    named = ["tests/gpu/test_staging.py::test_copies_on_a_side_stream_are_fenced_too", "-q"]
    assert with_default_paths(named) == named


def test_no_gpu_test_needs_an_async_plugin():
    """The GPU image has pytest but no pytest-asyncio: a coroutine test there fails before it
    runs ("async def functions are not natively supported"). GPU tests drive their event loop
    with `asyncio.run`."""
    root = Path(__file__).resolve().parents[2]
    files = [
        path
        for folder in DEFAULT_ARGS
        if (root / folder).is_dir()
        for path in sorted((root / folder).rglob("test_*.py"))
        if "mark.gpu" in path.read_text()
    ]
    assert len(files) > 5
    found = [
        f"{path.relative_to(root)}:{node.lineno} {node.name}"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.AsyncFunctionDef) and node.name.startswith("test")
    ]
    assert found == []
