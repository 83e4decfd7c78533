"""Draft vocabularies for a Zipf pair (benchmarks.realistic_zipf) and the benchmark that weighs
them against the full LM head (benchmarks.bench_draft_vocab), on a small Zipf pair."""

import json

import numpy as np
import pytest

from benchmarks import bench_draft_vocab, realistic_pair, realistic_zipf
from support.realistic_shapes import ZIPF_SMALL as SMALL


@pytest.fixture(scope="module")
def zipf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("zipf")
    pair = root / "pair"
    assert realistic_pair.main([str(pair), *SMALL, "--zipf", "1.0", "--residual-scale",
                                "0.02"]) == 0
    assert realistic_zipf.main([str(pair), str(root / "vocab"), "--sizes", "1024,3072",
                                "--corpus-tokens", "200000", "--ship", "3072"]) == 0
    return pair, root / "vocab"


def test_sidecars_keep_the_most_frequent_ids_of_the_drawn_corpus(zipf_pair):
    import mlx_mtp
    from mlx_mtp.models.qwen3_5 import vocab_reduction

    pair, vocab = zipf_pair
    model, tokenizer = mlx_mtp.load(str(pair))
    rank = np.asarray(realistic_zipf.pair_ranks(model))
    covered = []
    for size in (1024, 3072):
        meta = json.loads((vocab / str(size) / vocab_reduction.META_FILE).read_text())
        assert (meta["size"], meta["corpus_tokens"], meta["corpus"]) == \
            (size, 200000, {"zipf": 1.0, "seed": 0})
        ids = np.asarray(vocab_reduction.load_ids(vocab / str(size), tokenizer, model.target))
        assert ids.size == size and 0 in ids  # EOS always drafts
        # the drawn corpus ranks ids as the pair does: most of the kept ids are the top ranks
        assert np.mean(rank[ids] <= size) > 0.8
        assert meta["coverage"] == pytest.approx(
            realistic_zipf.zipf_share(size, 12288, 1.0), abs=0.03)
        covered.append(meta["coverage"])
    assert covered[0] < covered[1]
    # --ship: the loader drafts over the shipped sidecar by default
    assert np.array_equal(np.asarray(model.drafter.lm.ids),
                          np.asarray(vocab_reduction.load_ids(vocab / "3072", tokenizer,
                                                              model.target)))


def test_sidecars_need_a_zipf_pair_and_sizes_below_the_vocabulary(zipf_pair, tmp_path):
    pair, _ = zipf_pair
    plain = tmp_path / "plain"
    realistic_pair.main([str(plain), *SMALL, "--residual-scale", "0.02"])
    with pytest.raises(SystemExit, match="is not a --zipf pair"):
        realistic_zipf.main([str(plain), str(tmp_path / "v")])
    with pytest.raises(SystemExit) as e:
        realistic_zipf.main([str(pair), str(tmp_path / "v"), "--sizes", "1024", "--ship", "2048"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match=r"--sizes must lie between 1 and 12287, got \[12288\]"):
        realistic_zipf.main([str(pair), str(tmp_path / "v"), "--sizes", "12288"])
    assert not (tmp_path / "v").exists()


def test_bench_draft_vocab_writes_markdown_json_and_pictures(zipf_pair, tmp_path):
    pair, vocab = zipf_pair
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"a": "def f(x):", "b": "The sea was"}))
    bench_draft_vocab.main(["--model", str(pair), "--draft-vocabs", str(vocab / "1024"),
                            str(vocab / "3072"), "--block-sizes", "3,4", "--pairs", "1",
                            "--max-tokens", "16", "--prompts-json", str(prompts),
                            "--out", str(tmp_path / "out"), "--topic", "smoke", "--summary",
                            "smoke", "--allow-busy", "--idle-window", "0.2"])
    data = json.loads(next((tmp_path / "out").glob("smoke-*.json")).read_text())
    rows = {row["arm"]: row for row in data["rows"]}
    assert list(rows) == ["3/full", "3/1024", "3/3072", "4/full", "4/1024", "4/3072"]
    assert all(row["identical"] for row in rows.values())  # a draft vocabulary never changes text
    for b in (3, 4):
        full, small, large = rows[f"{b}/full"], rows[f"{b}/1024"], rows[f"{b}/3072"]
        assert full["ratio_vs_full"] == 1.0 and full["text_coverage"] == 1.0
        assert 0 < small["text_coverage"] <= large["text_coverage"] < 1
        # one draft step reads the kept rows only (float32, hidden 128)
        assert (full["lm_head_bytes"], small["lm_head_bytes"], large["lm_head_bytes"]) == \
            (12288 * 128 * 4, 1024 * 128 * 4, 3072 * 128 * 4)
        assert len(small["per_position_acceptance"]) == b - 1
        assert small["draft_ms_per_round"] > 0 and small["accept_ms_per_round"] > 0
    assert set(data["draft_vocabs"]) == {"1024", "3072"}
    assert len(data["raw"]["plain"]) == len(data["raw"]["4/1024"]) == 2  # 2 prompts x 1 pair
    md = next((tmp_path / "out").glob("smoke-*.md")).read_text()
    assert "| 4/1024 | " in md and md.rstrip().endswith("smoke")
    if bench_draft_vocab.common.plots.available():
        assert len(list((tmp_path / "out").glob("smoke-*.png"))) == 2


def test_a_sidecar_of_another_pair_is_refused(zipf_pair, tmp_path, capsys):
    pair, _ = zipf_pair
    other = tmp_path / "other"
    realistic_pair.main([str(other), *SMALL, "--zipf", "1.0", "--seed", "1",
                         "--residual-scale", "0.02"])
    realistic_zipf.main([str(other), str(tmp_path / "ov"), "--sizes", "1024",
                         "--corpus-tokens", "1000"])
    with pytest.raises(SystemExit, match="is not a draft vocabulary of this pair"):
        bench_draft_vocab.main(["--model", str(pair), "--draft-vocabs", str(tmp_path / "ov/1024"),
                                "--out", str(tmp_path / "out"), "--allow-busy"])
    with pytest.raises(SystemExit) as e:
        bench_draft_vocab.main(["--model", str(pair)])
    assert e.value.code == 2
    assert "--draft-vocabs: at least one sidecar folder is required" in capsys.readouterr().err
