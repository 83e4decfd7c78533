"""tools.draft_acceptance: the expected drafts kept per chain is block verification's, and
the script runs end to end (smoke run on the tiny soft pair)."""

import json

import mlx.core as mx
import pytest

from mlx_mtp.decoding import sampling
from tools import draft_acceptance

P = mx.array([[0.5, 0.2, 0.1, 0.1, 0.1, 0.0],
              [0.1, 0.6, 0.1, 0.0, 0.1, 0.1],
              [0.3, 0.3, 0.2, 0.1, 0.05, 0.05]])
Q = mx.array([[0.3, 0.4, 0.1, 0.0, 0.1, 0.1],
              [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])


def test_one_draft_expected_kept_averages_to_the_overlap():
    """Over d ~ q, E[kept | d] = min(1, p(d) / q(d)) averages to sum_x min(p(x), q(x))."""
    mean = sum(float(Q[0, d]) * draft_acceptance.expected_kept(P[:2], Q[:1],
                                                               mx.array([d], dtype=mx.uint32))[0]
               for d in range(6) if float(Q[0, d]) > 0)
    assert mean == pytest.approx(float(mx.minimum(P[0], Q[0]).sum()), abs=1e-6)


def test_expected_kept_is_what_the_loops_verdicts_keep():
    """For one chain of two drafts, the mean kept over the loop's own ``verdicts`` with fresh
    coins matches the exact expectation (and its one-draft prefix too)."""
    drafts = mx.array([1, 0], dtype=mx.uint32)
    want = draft_acceptance.expected_kept(P, Q, drafts)
    n, key = 3000, mx.random.key(0)
    coins = mx.random.uniform(shape=(n, 2), key=key)
    u = mx.random.uniform(shape=(3,), key=mx.random.key(1))
    kept = [sum(sampling.verdicts(P, Q, drafts, coins[i], u)[0].tolist()) for i in range(n)]
    mean = sum(kept) / n
    sd = (sum((x - mean) ** 2 for x in kept) / n / n) ** 0.5
    assert 0 < want[0] < want[1] < 2
    assert abs(mean - want[1]) < 4 * sd + 1e-3, (mean, want, sd)
    kept1 = [sum(sampling.verdicts(P[:2], Q[:1], drafts[:1], coins[i, :1], u[:2])[0].tolist())
             for i in range(n)]
    assert abs(sum(kept1) / n - want[0]) < 0.04


def test_the_script_runs_and_reports_every_variant(soft_dir, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"a": "def f(x):", "b": "class A:"}))
    out = tmp_path / "out.json"
    result = draft_acceptance.main(["--model", str(soft_dir), "--temp", "1.0", "--max-tokens", "9",
                                    "--prompts-json", str(prompts), "--chains", "2",
                                    "--stride", "4", "--drafts", "3",
                                    "--variants", "T=1;T=0.5,top-k=3;greedy", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert list(result["summary"]) == ["T=1", "T=0.5,top-k=3", "greedy"]
    for name, e in result["prompts"].items():
        assert e["positions"] == 8
        assert all(0 <= a <= 1 + 1e-6 for v in e["one_draft"].values() for a in v)
        assert all(len(e["kept"][v]) == 2 for v in result["variants"])  # positions L, L + 4
        assert all(0 <= r[0] <= r[1] + 1e-6 <= r[2] + 2e-6 <= 3.0 for v in e["kept"].values()
                   for r in v)


def test_a_bad_variant_is_refused():
    with pytest.raises(SystemExit) as e:
        draft_acceptance.parse_variant("temp=0.5")
    assert str(e.value) == "--variants: 'temp=0.5' is not T=t[,top-k=n][,top-p=x] or greedy"
