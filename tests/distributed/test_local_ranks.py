"""``benchmarks.harness.launch.LocalRanks``: ranks joined by the ring backend without mlx.launch."""

import json
import sys

import pytest

from benchmarks.harness.launch import LocalRanks

pytestmark = pytest.mark.subprocess  # every test runs rank processes (mlx.launch or by hand)

RANK_SCRIPT = """
import json, sys
import mlx.core as mx
g = mx.distributed.init(backend="ring", strict=True)
s = mx.distributed.all_sum(mx.array([g.rank() + 1.0]), group=g)
open(sys.argv[1] + f"/rank{g.rank()}.json", "w").write(
    json.dumps({"rank": g.rank(), "size": g.size(), "sum": s.item()}))
"""


def test_two_local_ranks_form_a_ring(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ranks = LocalRanks([sys.executable, script, tmp_path], ranks=2)
    assert ranks.wait(timeout=120) == 0
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got == [{"rank": 0, "size": 2, "sum": 3.0}, {"rank": 1, "size": 2, "sum": 3.0}]


def test_a_failing_rank_gives_its_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(7 if os.environ['MLX_RANK'] == '1' else 0)\n")
    assert LocalRanks([sys.executable, script], ranks=2).wait(timeout=60) == 7
