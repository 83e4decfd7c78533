"""A target split over 2 real processes on this machine (issue 18): ``mlx.launch --backend ring
-n 2`` runs ``split_worker.py`` (fresh interpreters: spawn-safe) on a tiny checkpoint whose MTP
head agrees with its target, for both of mlx-lm's splits.

Checked on every rank: T=0 ids of MTP == the same split target's plain decode (mlx-lm) == the MTP
loop at block 1 == one unsplit process (the probe says equal); the cache state after every round
equals, bitwise, the single-token chain's at the same length; a rank that dies or hangs ends the
other with one error line within a bounded time; sampled at T=1, every rank draws the same ids.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import tiny_checkpoints as tc
from benchmarks.harness import launch
from mlx_mtp.models.distributed import TIMEOUT_ENV, WATCHDOG_EXIT

pytestmark = pytest.mark.subprocess  # every test runs rank processes (mlx.launch or by hand)

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("split_worker.py")
MAX_TOKENS = 12
LAUNCH_TIMEOUT_S = 600  # both ranks load, probe and run three arms on 2 shared cores


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "MLX_HOSTFILE")}
    return dict(env, PYTHONPATH=str(REPO), **extra)


# (checkpoint, split): Qwen3.5 with a head that agrees with its target (drafts kept, partial
# rollbacks) both ways; Qwen3-Next (pipeline only in mlx-lm) with a random head (every draft
# rejected: a rollback every round).
RUNS = [("agree", "pipeline"), ("agree", "tensor"), ("next", "pipeline")]


@pytest.fixture(scope="module")
def agree_dir(tmp_path_factory):
    return tc.write_agreeing_checkpoint(tmp_path_factory.mktemp("split") / "agree")


@pytest.fixture(scope="module")
def checkpoints(agree_dir, tmp_path_factory):
    return {"agree": agree_dir,
            "next": tc.write_raw_hf_qwen3_next(tmp_path_factory.mktemp("split") / "next")}


@pytest.fixture(scope="module")
def one_process(checkpoints, tmp_path_factory):
    """Each checkpoint's MTP ids in one unsplit process."""
    refs = {}
    for name, path in checkpoints.items():
        out = tmp_path_factory.mktemp(f"alone_{name}")
        subprocess.run([sys.executable, str(WORKER), str(path), "none", str(out),
                        str(MAX_TOKENS)], env=_env(), check=True, timeout=LAUNCH_TIMEOUT_S)
        refs[name] = json.loads((out / "result.rank0.json").read_text())
    return refs


@pytest.fixture(scope="module", params=RUNS, ids=["-".join(r) for r in RUNS])
def split_run(request, checkpoints, tmp_path_factory):
    name, split = request.param
    out = tmp_path_factory.mktemp(f"{name}_{split}")
    log = out / "launch.log"
    proc = launch.start([sys.executable, WORKER, checkpoints[name], split, out, MAX_TOKENS],
                        env=_env(), log=log)
    try:
        proc.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # mlx.launch exits 0 whatever its ranks do; it reports a failed one in a warning line.
    assert not re.search(r"Node with rank \d+ (exited|was killed)", log.read_text()), \
        log.read_text()[-3000:]
    ranks = [json.loads((out / f"result.rank{r}.json").read_text()) for r in (0, 1)]
    return name, split, out, ranks


def _log(path: Path):
    return [(int(n), h) for n, h in (line.split() for line in path.read_text().splitlines())]


def test_split_output_equals_plain_decode_and_one_process(split_run, one_process):
    name, split, _, ranks = split_run
    reference = one_process[name]["mtp"]["tokens"]
    assert len(reference) == MAX_TOKENS
    for r, res in enumerate(ranks):
        assert res["rank"] == r
        mtp = res["mtp"]
        assert mtp["split"] == f"{split} over 2 ranks"
        assert mtp["mtp_enabled"] and mtp["exactness"]["verdict"] == "equal"
        if name == "agree":  # drafts kept, partial rollbacks
            assert mtp["accepted"] > 0
        else:  # the random head: every draft rejected, a rollback every round
            assert mtp["accepted"] == 0 and mtp["rounds"] == MAX_TOKENS - 1
        assert mtp["tokens"] == res["plain"]["tokens"] == res["chain"]["tokens"]
        assert mtp["tokens"] == reference  # the probe said equal: as one unsplit process


def test_split_caches_equal_the_chain_after_every_round(split_run):
    _, split, out, ranks = split_run
    for r, res in enumerate(ranks):
        mtp, chain = _log(out / f"mtp.rank{r}"), dict(_log(out / f"chain.rank{r}"))
        assert len(mtp) == res["mtp"]["rounds"] + 1  # after the prefill, then every round
        lengths = [n for n, _ in mtp]
        # From the prompt to every token but the last one emitted (sampled, not yet fed).
        assert lengths == sorted(set(lengths))
        assert lengths[0] == res["mtp"]["prompt_tokens"] == 12
        assert lengths[-1] == 12 + MAX_TOKENS - 1
        for n, digest in mtp:
            assert chain[n] == digest, f"rank {r}: cache differs from the chain at length {n}"
    if split == "pipeline":  # each rank holds other layers: the states are its own
        assert _log(out / "mtp.rank0")[-1][1] != _log(out / "mtp.rank1")[-1][1]


def test_split_auto_block_size_verifies_rank0s_choice_everywhere(split_run):
    _, _, out, ranks = split_run
    logs = [_log(out / f"auto.rank{r}") for r in (0, 1)]
    # Same rounds and committed lengths on both ranks (each times its own rounds, but every rank
    # verifies rank 0's choice), and each rank's caches are the chain's at those lengths.
    assert [n for n, _ in logs[0]] == [n for n, _ in logs[1]]
    for r, res in enumerate(ranks):
        assert res["auto"]["tokens"] == res["plain"]["tokens"]
        assert len(logs[r]) == res["auto"]["rounds"] + 1
        chain = dict(_log(out / f"chain.rank{r}"))
        assert all(chain[n] == digest for n, digest in logs[r])


def test_split_sampling_draws_the_same_tokens_on_every_rank(split_run):
    _, _, out, ranks = split_run
    assert ranks[0]["sampled"]["seed"] == ranks[1]["sampled"]["seed"]
    assert ranks[0]["sampled"]["tokens"] == ranks[1]["sampled"]["tokens"]
    assert len(ranks[0]["sampled"]["tokens"]) == MAX_TOKENS
    for r in (0, 1):  # one line after the prefill and after each round: no rank fell behind
        assert len(_log(out / f"sampled.rank{r}")) == ranks[r]["sampled"]["rounds"] + 1


def test_split_drafts_apply_the_logits_processors(split_run):
    """With a repetition penalty every rank drafts the processed picks (on a tensor split, from
    the gathered logits): the same rounds and kept drafts on both ranks, plain decode's tokens."""
    _, _, _, ranks = split_run
    for res in ranks:
        assert res["penalized"]["draft_processors"] == "applied"
        assert res["penalized"]["tokens"] == res["plain_penalized"]["tokens"]
    assert ranks[0]["penalized"] == ranks[1]["penalized"]


def test_split_collectives_per_token(split_run):
    _, split, _, ranks = split_run
    for res in ranks:
        mtp, chain = res["mtp"], res["chain"]
        if mtp["accepted"]:  # fewer forwards than tokens
            assert mtp["split_messages_per_token"] < chain["split_messages_per_token"]
        if split == "pipeline":
            # Two collectives per forward on either rank (send or recv, then the all-gather);
            # forwards = the two prefill steps + one per round.
            for arm in (mtp, chain):
                assert arm["split_messages"] == 2 * (2 + arm["rounds"])


def _launch_by_hand(tmp_path, agree_dir, split):
    """The two ranks started without mlx.launch (which would end the survivor itself)."""
    port = launch.free_port_pair()
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(agree_dir), split,
                               str(tmp_path), "100000"],
                              env=_env(MLX_RANK=str(r), MLX_HOSTFILE=str(hosts),
                                       **{TIMEOUT_ENV: "10"}),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    log = tmp_path / "mtp.rank1"
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, "the ranks never started generating"
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-2000:]
        time.sleep(0.2)
    return procs


@pytest.mark.parametrize("sig, rc, message", [
    (signal.SIGKILL, 1, "error: rank 0 of 2 (pipeline split): generation failed, another rank "
                        "died ([ring] connection to a peer was lost)"),
    (signal.SIGSTOP, WATCHDOG_EXIT, "error: rank 0 of 2 (pipeline split): no progress in "
                                    "generation for 10 s: another rank died or hangs (set "
                                    f"{TIMEOUT_ENV} to wait longer)"),
], ids=["killed", "hung"])
def test_a_dead_or_hung_rank_ends_the_other_with_an_error(tmp_path, agree_dir, sig, rc, message):
    procs = _launch_by_hand(tmp_path, agree_dir, "pipeline")
    try:
        os.kill(procs[1].pid, sig)
        t0 = time.monotonic()
        assert procs[0].wait(timeout=60) == rc  # bounded: never a hang
        assert time.monotonic() - t0 < 60
        assert procs[0].stderr.read().strip().splitlines()[-1] == message
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stderr.close()
