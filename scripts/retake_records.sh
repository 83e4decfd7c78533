#!/usr/bin/env bash
# Re-take every record in benchmark_results/ on an idle machine, with the idle check in each.
#
#   bash scripts/retake_records.sh            # from the repository root; ~1 h on 2 cores
#   bash scripts/retake_records.sh STEM...    # only the records named (old stems, as below)
#
# Nothing else may run meanwhile (no tests, no helpers, no second benchmark): each script
# refuses a busy machine (exit 1, one line) and this script then stops, so the remaining
# records are not taken on a machine known to be busy. Each command is the one in the old
# record's json ("command", "env"); records are named <topic>-<host>-<date of the run>, so a
# re-take gets today's date and the superseded file of an earlier date is git rm'ed.
# The README quotes only these re-taken records (update it after). Each script waits up to 10
# minutes for a quiet machine before and after its run; those that measure in units (an
# alternating pair, a round: bench_mtp.py, cli_pairs.py, blas_spread.py) measure a unit the
# machine was not quiet for again, up to 60 times a run (scripts/idle_check.py).
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
ONLY=("$@")
for stem in "${ONLY[@]}"; do  # a stem no retake line names would be skipped silently
  grep -q "^ *retake $stem " "$SELF" \
    || { echo "retake_records.sh: no record $stem (expected an old stem a retake line names)" >&2
         exit 2; }
done

export PYTHONPATH="$PWD"
PY=${PYTHON:-python}
WAIT=(--wait-idle 600)
UNITS=(--wait-idle 600 --retakes 60)
STDLIB=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
BLIS=$($PY -c 'from mlx_mtp import cpu_blas; print(next(p for n, p in cpu_blas.find() if n == "BLIS"))')
OPENBLAS=$($PY -c 'from mlx_mtp import cpu_blas; print(next(p for n, p in cpu_blas.find() if n == "OpenBLAS"))')

# retake OLD_STEM ENV... -- COMMAND...: run it; on success drop the superseded record.
retake() {
  local old=$1; shift
  if [ ${#ONLY[@]} -gt 0 ] && ! printf '%s\n' "${ONLY[@]}" | grep -qx "$old"; then return 0; fi
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local start; start=$(date +%s)
  echo "== $old: $*"
  env -u BLIS_NUM_THREADS -u BLIS_JC_NT -u OPENBLAS_NUM_THREADS -u OMP_NUM_THREADS \
      -u MLX_MTP_CPU_BLAS "${envs[@]}" "$@"
  for f in "benchmark_results/$old.json" "benchmark_results/$old.md"; do
    if [ -e "$f" ] && [ "$(stat -c %Y "$f")" -lt "$start" ]; then git rm -q "$f"; fi
  done
}

# This machine's idle bandwidth figure (the idle check compares a probe against it). Re-taking
# only some records keeps the figure this machine has, if any: re-measured, it would change a
# tracked file before each record, whose commit then reads +dirty.
if [ ${#ONLY[@]} -eq 0 ] || ! $PY -c 'import sys; sys.path.insert(0, "scripts")
import idle_check; sys.exit(idle_check.idle_bandwidth() is None)'; then
  $PY scripts/idle_check.py --calibrate
fi

# T=0, block sizes 1-5: BLIS (its default threads now: cores - 1, over columns) and OpenBLAS.
retake demo-pair-blis-vm-2026-12-03 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis --block-sizes 1,2,3,4,5,6,auto \
  --pairs 6 --max-tokens 128 "${UNITS[@]}"
# issue 16: auto against the blocks that can be best, with enough pairs to tell a loss from noise
retake demo-pair-blis-auto-vm-2026-12-03 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-auto --block-sizes 3,4,5,6,auto \
  --pairs 10 --max-tokens 128 "${UNITS[@]}"
# issue 16: auto on three more code prompts, where blocks 3-5 beat 6
retake demo-pair-blis-auto-code-vm-2026-12-03 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-code \
  --prompts-json tests/data/demo_pair_code_prompts.json --block-sizes 3,4,5,6,auto \
  --pairs 6 --max-tokens 128 "${UNITS[@]}"
# issue 16 at the CLI's default length (256 tokens): the chooser's first rounds, which measure,
# weigh half as much as in a 128-token generation
retake demo-pair-blis-auto-256-vm-2026-12-03 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-256 --block-sizes 3,4,5,6,auto \
  --pairs 10 --max-tokens 256 "${UNITS[@]}"
retake demo-pair-blis-auto-code-256-vm-2026-12-03 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-code-256 \
  --prompts-json tests/data/demo_pair_code_prompts.json --block-sizes 3,4,5,6,auto \
  --pairs 6 --max-tokens 256 "${UNITS[@]}"
# issue 16 at 512 tokens: where the replays say a chooser that measures can reach the best fixed
# block (README: *Where the limit is*)
retake demo-pair-blis-auto-512-vm-2026-12-03 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-512 --block-sizes 3,4,5,6,auto \
  --pairs 8 --max-tokens 512 "${UNITS[@]}"
retake demo-pair-blis-auto-code-512-vm-2026-12-03 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-code-512 \
  --prompts-json tests/data/demo_pair_code_prompts.json --block-sizes 3,4,5,6,auto \
  --pairs 6 --max-tokens 512 "${UNITS[@]}"
retake demo-pair-openblas-vm-2026-12-03 MLX_MTP_CPU_BLAS="$OPENBLAS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-openblas --block-sizes 1,2,3,4,6,auto \
  --pairs 8 --synced-runs 3 --max-tokens 128 "${UNITS[@]}"

# T=0.6 speculative sampling with BLIS against plain sampling; blocks up to 6 since block
# verification keeps more drafts the longer the block.
retake demo-pair-blis-T0.6-speculative-sampling-vm-2026-12-02 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-T0.6-speculative-sampling \
  --temp 0.6 --acceptance speculative-sampling --seed 0 --block-sizes 2,3,4,5,6 --pairs 5 --max-tokens 128 "${UNITS[@]}"

# T=1.0 speculative sampling with BLIS.
# auto at T > 0 (Gumbel-coupled keyed draws) against fixed blocks (speculative sampling)
retake demo-pair-blis-T0.6-auto-vm-2026-12-03 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-T0.6-auto --temp 0.6 --seed 0 \
  --block-sizes 3,4,auto --pairs 5 --max-tokens 128 "${UNITS[@]}"
retake demo-pair-blis-T1.0-speculative-sampling-vm-2026-12-02 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_mtp.py --model mlx_mtp/demo_pair --topic demo-pair-blis-T1.0-speculative-sampling \
  --temp 1.0 --acceptance speculative-sampling --seed 0 --block-sizes 2,3,4 --pairs 3 --max-tokens 128 "${UNITS[@]}"

# The CLI's default run against --no-mtp, alternating pairs of fresh processes (issue 12's CLI bar).
retake cli-default-vm-2026-12-03 -- $PY scripts/cli_pairs.py --pairs 5 "${UNITS[@]}"

# Drafter phases: the random pair, and the trained demo pair with the draft vocabulary it ships
# (mlx_mtp/demo_pair/mtp/draft_vocab: 4096 ids, built by
# python -m mlx_mtp.draft_vocab build --model mlx_mtp/demo_pair --size 4096 --corpus FILES over the
# 48 standard-library files of mlx_mtp/demo_pair/mtp/draft_vocab/draft_vocab.json's "corpus").
retake drafter-phases-vm-2026-12-01 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_drafter.py --max-tokens 24 --pairs 5 "${WAIT[@]}"
retake drafter-phases-demo-pair-vm-2026-12-01 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/bench_drafter.py --model mlx_mtp/demo_pair --pairs 5 --topic drafter-phases-demo-pair "${WAIT[@]}"

# The exactness probe's cost.
retake probe-cost-vm-2026-12-01 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY scripts/probe_cost.py --record --repeats 5 "${WAIT[@]}"

# The spread across fresh processes per BLAS choice, with the one-process control (issue 17).
retake blas-spread-vm-2026-12-01 -- $PY scripts/blas_spread.py --processes 5 --max-tokens 128 "${UNITS[@]}"
# issue 17's bar: the default BLAS alone, the CLI's default run (256 tokens)
retake blas-spread-vm-2026-12-02 -- $PY scripts/blas_spread.py --processes 5 --arms default "${UNITS[@]}"

# Converted folders (issue 15), a target split over 2 local processes (issue 18), the server.
retake convert-demo-pair-vm-2026-12-01 -- $PY scripts/bench_convert.py --pairs 3 --max-tokens 128 "${WAIT[@]}"
retake split-vm-2026-12-01 -- $PY scripts/bench_split.py --pairs 3 --max-tokens 128 "${WAIT[@]}"
retake server-demo-pair-vm-2026-12-01 -- \
  $PY scripts/bench_server.py --pairs 5 --max-tokens 128 --clients 4 --requests 3 "${WAIT[@]}"

# A realistic-size random pair (issue 12), built as in shared/design/round-cost.md into $BIG_PAIR.
if [ -n "${BIG_PAIR:-}" ]; then
  retake big-pair-blis-vm-2026-12-02 -- $PY scripts/bench_mtp.py --model "$BIG_PAIR" \
    --topic big-pair-blis --block-sizes 1,2,3,auto --pairs 2 --max-tokens 96 "${UNITS[@]}"
fi
