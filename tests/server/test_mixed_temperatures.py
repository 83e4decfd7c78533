"""One server, requests at both temperatures, on a target whose probe diverges: each request gets
the decision for its own temperature. ``MLX_MTP_ROW_EXACT=0`` on the wide test checkpoint makes
the probe diverge where the BLAS reduces wide rows differently (BLIS); elsewhere the T=0 decision
follows whatever the probe finds."""

import pytest

from benchmarks.harness.server_process import ServerProcess

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def test_each_request_gets_the_decision_for_its_temperature(wide_dir):
    import os

    env = dict(os.environ, MLX_MTP_ROW_EXACT="0")
    with ServerProcess("--model", str(wide_dir), "--block-size", "3", env=env) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        health = server.get("/health")
        cold = client.completions.create(model="x", prompt="ab", max_tokens=6, temperature=0)
        hot = client.completions.create(model="x", prompt="ab", max_tokens=6, temperature=0.8,
                                        seed=1)
    assert health["sampling"]["mtp_enabled"] is True
    assert health["sampling"]["gate_reason"].startswith("temperature > 0")
    t0 = cold.model_extra["mtp"]
    assert t0["mtp_enabled"] == health["mtp_enabled"]
    if not health["mtp_enabled"]:  # the probe diverged (BLIS): declined, with its reason
        assert "MLX_MTP_ROW_EXACT=0" in health["gate_reason"] and t0["rounds"] == 0
    t1 = hot.model_extra["mtp"]
    assert t1["mtp_enabled"] is True and t1["rounds"] > 0
    assert t1["gate_reason"] == health["sampling"]["gate_reason"]
