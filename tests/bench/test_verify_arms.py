"""scripts/verify_arms.py: every arm timed on a tiny wide target, the layers' choices restored."""

import json
import sys
from pathlib import Path

import mlx_mtp
from mlx_mtp import cpu_blas, row_exact, row_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import verify_arms  # noqa: E402


def test_verify_arms_reports_every_arm_against_the_decode_step(wide_dir, capsys):
    assert verify_arms.main(["--model", str(wide_dir), "--width", "3", "--reps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["ms"]) == list(verify_arms.ARMS) == list(out["x_decode"])
    assert all(v > 0 for v in out["ms"].values()) and out["x_decode"]["decode"] == 1.0
    assert out["width"] == 3 and out["reps"] == 2 and out["blas"] == cpu_blas.STATE.describe()
    assert out["kernel_threads"] == 1
    if cpu_blas.STATE.name == "BLIS" and row_kernel.available():
        assert out["kernel_layers"] == out["row_exact"]["layers"]["kernel"] >= 20


def test_the_arms_leave_the_installed_choice_as_it_was(wide_dir):
    model = mlx_mtp.load_model(wide_dir, require_head=False)
    model.target.prepare(3)

    def choices():
        return {n: (row_exact.method(m), m.block_cols) for n, m in
                model.mlx_model.named_modules() if row_exact.method(m) != "multi-row"}

    before = choices()
    if cpu_blas.STATE.name == "BLIS":  # its multi-row products differ for 576-wide inputs
        assert len(before) >= 20
    out = verify_arms.measure(model, 3, 1, kernel_threads=2)
    assert out["kernel_threads"] == 2
    assert choices() == before and model.target.exact is True
    assert row_exact.kernel_threads() == 1  # the kernel arm's threads were its own
