"""tools/retake_records.sh TOPIC...: only the topics named; a name no retake line has is an error
before anything runs (it would otherwise be skipped without a word)."""

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "retake_records.sh"


def test_an_unknown_stem_is_refused_before_anything_runs(tmp_path):
    known = re.search(r"^retake (\S+) ", SCRIPT.read_text(), re.M).group(1)  # passes the check
    run = subprocess.run(["bash", str(SCRIPT), known, "no-such-record"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stdout == ""  # no calibration, no record: it stopped first
    assert run.stderr == ("retake_records.sh: no record no-such-record (expected a topic a "
                          "retake line names)\n")
