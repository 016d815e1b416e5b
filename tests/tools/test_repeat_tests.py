"""`tools.repeat_tests` runs a test in new processes and counts the runs that failed."""

from __future__ import annotations

import json

from tools import repeat_tests

FLAKY = '''
from pathlib import Path

def test_fails_every_other_run():
    counter = Path(__file__).with_name("runs.txt")
    runs = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(runs))
    assert runs % 2 == 1, "an even run"
'''


def test_counts_the_runs_that_failed_and_names_the_test(tmp_path, capsys):
    test_file = tmp_path / "test_flaky.py"
    test_file.write_text(FLAKY)
    out = tmp_path / "counts.json"
    status = repeat_tests.main(["-n", "3", "--out", str(out), str(test_file)])
    assert status == 1
    counts = json.loads(out.read_text())
    assert (counts["runs"], counts["failed_runs"]) == (3, 1)
    assert [r["passed"] for r in counts["each"]] == [True, False, True]
    (failed,) = counts["each"][1]["failed"]
    assert failed.endswith("test_flaky.py::test_fails_every_other_run"), failed
    assert "2 of 3 runs passed" in capsys.readouterr().out
