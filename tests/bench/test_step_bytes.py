"""benchmarks.common.step_bytes: what one drafter step reads, for the Qwen head (its weights and
the LM head it borrows) and for the Gemma 4 assistant (its own weights; with the centroid head
only the clusters a step ranks)."""

import pytest
from support.tiny_gemma4 import Checkpoints

import mlx_mtp
from benchmarks.common import nbytes, step_bytes


def test_the_qwen_head_reads_its_weights_and_the_borrowed_lm_head(dense_dir):
    model = mlx_mtp.load_model(dense_dir)
    got = step_bytes(model)
    assert got["drafter_step_bytes"] == nbytes(model.drafter.head) + got["lm_head_bytes"]
    assert got["drafter_step_reads"] == "head + borrowed LM head"


def test_a_draft_vocabulary_reads_only_its_rows(tmp_path):
    """The demo pair ships a 4096-id draft vocabulary: a step reads the head and 4096 of the
    LM head's 8192 rows (stored transposed, float32 after the cast)."""
    from mlx_mtp.demo import demo_path

    model = mlx_mtp.load_model(str(demo_path()))
    got = step_bytes(model)
    rows = model.drafter.lm.tensors.nbytes
    hidden = model.target.args.hidden_size
    assert rows == 4096 * hidden * model.drafter.lm.tensors.weight.itemsize
    assert got["drafter_step_bytes"] == nbytes(model.drafter.head) + rows
    assert got["drafter_step_reads"] == \
        f"head + the LM head's 4096 draft-vocabulary rows {rows / 1e6:.1f} MB"


@pytest.mark.parametrize("kind", ["31b", "e2b"])
def test_the_gemma4_assistant_reads_itself_and_only_the_ranked_clusters(tmp_path_factory, kind):
    pair = Checkpoints(tmp_path_factory)
    model = mlx_mtp.load_model(str(pair.target(kind)), drafter=str(pair.assistant(kind)))
    a = model.drafter.assistant
    got = step_bytes(model)
    head = nbytes(a.model.embed_tokens)
    if kind == "e2b":  # 16 clusters, the top 4 ranked a step
        assert got["drafter_step_bytes"] == nbytes(a) - round(head * (1 - 4 / 16))
    else:
        assert got["drafter_step_bytes"] == nbytes(a)
    assert got["drafter_step_reads"] == "the assistant, its own head included"
