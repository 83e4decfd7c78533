#!/usr/bin/env bash
# Re-take every record in benchmark_results/ on an idle machine, with the idle check in each.
#
#   bash tools/retake_records.sh              # every topic; about 1 h on 2 cores
#   bash tools/retake_records.sh TOPIC...     # only these topics (as the retake lines name them)
#
# Nothing else may run meanwhile (no tests, no helpers, no second benchmark): each benchmark
# refuses a busy machine (exit 1, one line) and this script then stops, so the remaining records
# are not taken on a machine known to be busy. A record is named <topic>-<host>-<date of the run>,
# so a re-take gets today's date; once it is written, every other file of its topic (older
# records, their markdown and pictures: benchmarks.common.superseded) is git rm'ed, and
# benchmark_results/ keeps the newest record of each topic only. Update the index of records in
# docs/benchmarks.md after. Each benchmark waits up to 10 minutes for a quiet machine before and
# after its run; those that measure in units (an alternating pair, a round: bench_mtp, cli_pairs,
# blas_spread) measure a unit the machine was not quiet for again, up to 60 times a run
# (benchmarks.idle).
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
ONLY=("$@")
for topic in "${ONLY[@]}"; do  # a topic no retake line names would be skipped silently
  awk '$1 == "retake" { print $2 }' "$SELF" | grep -qxF -- "$topic" \
    || { echo "retake_records.sh: no record $topic (expected a topic a retake line names)" >&2
         exit 2; }
done

export PYTHONPATH="$PWD"
PY=${PYTHON:-python}
WAIT=(--wait-idle 600)
UNITS=(--wait-idle 600 --retakes 60)
BLIS=$($PY -c 'from mlx_mtp.cpu import blas; print(next(p for n, p in blas.find() if n == "BLIS"))')
OPENBLAS=$($PY -c 'from mlx_mtp.cpu import blas; print(next(p for n, p in blas.find() if n == "OpenBLAS"))')

# retake TOPIC ENV... -- COMMAND...: run it; on success drop the topic's superseded files.
retake() {
  local topic=$1; shift
  if [ ${#ONLY[@]} -gt 0 ] && ! printf '%s\n' "${ONLY[@]}" | grep -qxF -- "$topic"; then
    return 0
  fi
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  echo "== $topic: $*"
  env -u BLIS_NUM_THREADS -u BLIS_JC_NT -u OPENBLAS_NUM_THREADS -u OMP_NUM_THREADS \
      -u MLX_MTP_CPU_BLAS "${envs[@]}" "$@"
  $PY -c 'import sys
from benchmarks.common import superseded
print("\n".join(str(p) for p in superseded(sys.argv[1])))' "$topic" |
    while read -r f; do
      [ -n "$f" ] || continue
      git rm -q -- "$f" 2>/dev/null || rm -f -- "$f"  # (an untracked file: just removed)
    done
}

# This machine's idle bandwidth figure (the idle check compares a probe against it). Re-taking
# only some topics keeps the figure this machine has, if any: re-measured, it would change a
# tracked file before each record, whose commit then reads +dirty.
if [ ${#ONLY[@]} -eq 0 ] || ! $PY -c 'import sys
from benchmarks import idle
sys.exit(idle.idle_bandwidth() is None)'; then
  $PY -m benchmarks.idle --calibrate
fi

# T=0 on the demo pair at the CLI's settings (its repetition penalty), BLIS (its default threads:
# cores - 1, over columns); every fixed block size and auto with OpenBLAS.
retake demo-pair-blis MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis --block-sizes 2,3,4,auto \
  --pairs 3 --max-tokens 256 --repetition-penalty 1.3 --repetition-context-size 48 \
  --synced-runs 1 "${UNITS[@]}"
retake demo-pair-openblas MLX_MTP_CPU_BLAS="$OPENBLAS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-openblas --block-sizes 1,2,3,4,6,auto \
  --pairs 8 --synced-runs 3 --max-tokens 128 "${UNITS[@]}"
# auto against the fixed blocks that can be best, with enough pairs to tell a loss from noise:
# the default prompts and three more code prompts, at 128, 256 (the CLI's default) and 512 tokens
retake demo-pair-blis-auto MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-auto --block-sizes 3,4,5,6,auto \
  --pairs 10 --max-tokens 128 "${UNITS[@]}"
retake demo-pair-blis-auto-code MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-code \
  --prompts code --block-sizes 3,4,5,6,auto --pairs 6 --max-tokens 128 "${UNITS[@]}"
retake demo-pair-blis-auto-256 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-256 --block-sizes 3,4,5,6,auto \
  --pairs 10 --max-tokens 256 "${UNITS[@]}"
retake demo-pair-blis-auto-code-256 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-code-256 \
  --prompts code --block-sizes 3,4,5,6,auto --pairs 6 --max-tokens 256 "${UNITS[@]}"
retake demo-pair-blis-auto-512 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-512 --block-sizes 3,4,5,6,auto \
  --pairs 8 --max-tokens 512 "${UNITS[@]}"
retake demo-pair-blis-auto-code-512 MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-auto-code-512 \
  --prompts code --block-sizes 3,4,5,6,auto --pairs 6 --max-tokens 512 "${UNITS[@]}"

# Sampling with BLIS against mlx-lm's plain sampling: speculative sampling at T=0.6 (blocks up to
# 6: block verification keeps more drafts the longer the block) and T=1.0, and auto at T=0.6
# (Gumbel-coupled keyed draws) against fixed blocks.
retake demo-pair-blis-T0.6-speculative-sampling MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-T0.6-speculative-sampling \
  --temp 0.6 --acceptance speculative-sampling --seed 0 --block-sizes 2,3,4,5,6 --pairs 5 --max-tokens 128 "${UNITS[@]}"
retake demo-pair-blis-T1.0-speculative-sampling MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-T1.0-speculative-sampling \
  --temp 1.0 --acceptance speculative-sampling --seed 0 --block-sizes 2,3,4 --pairs 3 --max-tokens 128 "${UNITS[@]}"
retake demo-pair-blis-T0.6-auto MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_mtp --model mlx_mtp/demo_pair --topic demo-pair-blis-T0.6-auto --temp 0.6 --seed 0 \
  --block-sizes 3,4,auto --pairs 5 --max-tokens 128 "${UNITS[@]}"

# The demo pair's code prompts with the drafts under its penalty, and with them not.
retake draft-processors-demo-pair MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_draft_processors --model mlx_mtp/demo_pair --topic draft-processors-demo-pair \
  --prompts code --block-sizes 3,4 --pairs 3 --max-tokens 256 --repetition-penalty 1.3 \
  --repetition-context-size 48 --unprocessed-drafts "${UNITS[@]}"

# The CLI's default run against --no-mtp, alternating pairs of fresh processes.
retake cli-default -- $PY -m benchmarks.cli_pairs --pairs 5 "${UNITS[@]}"

# Drafter phases: the random pair, and the trained demo pair with the draft vocabulary it ships
# (mlx_mtp/demo_pair/mtp/draft_vocab: 4096 ids, built by
# python -m mlx_mtp.draft_vocab build --model mlx_mtp/demo_pair --size 4096 --corpus FILES over the
# standard-library files listed in mlx_mtp/demo_pair/mtp/draft_vocab/draft_vocab.json's "corpus").
retake drafter-phases MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_drafter --max-tokens 24 --pairs 5 "${WAIT[@]}"
retake drafter-phases-demo-pair MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.bench_drafter --model mlx_mtp/demo_pair --pairs 5 --topic drafter-phases-demo-pair "${WAIT[@]}"

# The exactness probe's cost.
retake probe-cost MLX_MTP_CPU_BLAS="$BLIS" -- \
  $PY -m benchmarks.probe_cost --record --repeats 5 "${WAIT[@]}"

# The spread across fresh processes: the default BLAS alone on the CLI's default run (256
# tokens), and every BLAS choice side by side with the one-process control (128 tokens).
retake blas-spread -- $PY -m benchmarks.blas_spread --processes 5 --arms default "${UNITS[@]}"
retake blas-spread-arms -- \
  $PY -m benchmarks.blas_spread --topic blas-spread-arms --processes 5 --max-tokens 128 "${UNITS[@]}"

# Converted folders, a target split over 2 local processes, the server.
retake convert-demo-pair -- $PY -m benchmarks.bench_convert --pairs 3 --max-tokens 128 "${WAIT[@]}"
retake split -- $PY -m benchmarks.bench_split --pairs 3 --max-tokens 128 "${WAIT[@]}"
retake server-demo-pair -- \
  $PY -m benchmarks.bench_server --pairs 5 --max-tokens 128 --clients 4 --requests 3 "${WAIT[@]}"

# What sampling saves by promising the distribution (no probe, the fastest verify) at T=0.6.
retake sampling-gate-demo-pair -- $PY -m benchmarks.sampling_gate --model mlx_mtp/demo_pair \
  --topic sampling-gate-demo-pair --pairs 3 --max-tokens 128 --repetition-penalty 1.3 \
  --repetition-context-size 48 "${UNITS[@]}"

# Draft trees against chains on the demo pair's code prompts.
retake trees-demo-pair-code -- $PY -m benchmarks.bench_trees --model mlx_mtp/demo_pair \
  --arms 3,4,2t4x4,3t2x4,3t3x6,4t2x6 --pairs 3 --max-tokens 128 --prompts code \
  --topic trees-demo-pair-code "${UNITS[@]}"

# A realistic-size random pair (hidden 1024, 12 layers, 32k vocabulary, a head wired to agree
# with the target part of the time; not built by this repository), when $BIG_PAIR names its folder.
if [ -n "${BIG_PAIR:-}" ]; then
  retake big-pair-blis -- $PY -m benchmarks.bench_mtp --model "$BIG_PAIR" \
    --topic big-pair-blis --block-sizes 1,2,3,auto --pairs 2 --max-tokens 96 "${UNITS[@]}"
fi

# The realistic calibrated pairs, when $REALISTIC_PAIRS names a folder holding them (built by
# `python -m benchmarks.realistic_pair $REALISTIC_PAIRS/qwen3_5` and
# `... $REALISTIC_PAIRS/gemma4 --family gemma4`, about 30 minutes each with calibration).
if [ -n "${REALISTIC_PAIRS:-}" ]; then
  Q="$REALISTIC_PAIRS/qwen3_5"
  G=(--model "$REALISTIC_PAIRS/gemma4/target" --drafter "$REALISTIC_PAIRS/gemma4/assistant")
  retake realistic-pair-blis -- $PY -m benchmarks.bench_mtp --model "$Q" \
    --topic realistic-pair-blis --block-sizes 2,3,4,6,auto --pairs 2 --max-tokens 96 \
    --synced-runs 0 "${UNITS[@]}"
  retake realistic-pair-blis-T0.6 -- $PY -m benchmarks.bench_mtp --model "$Q" \
    --topic realistic-pair-blis-T0.6 --block-sizes 3,auto --temp 0.6 --seed 1 --pairs 2 \
    --max-tokens 96 --synced-runs 0 "${UNITS[@]}"
  retake realistic-gemma4-pair-blis -- $PY -m benchmarks.bench_mtp "${G[@]}" \
    --topic realistic-gemma4-pair-blis --block-sizes 2,3,4,6,auto --pairs 2 --max-tokens 96 \
    --synced-runs 0 "${UNITS[@]}"
  retake sampling-gate-realistic-pair -- $PY -m benchmarks.sampling_gate --model "$Q" \
    --topic sampling-gate-realistic-pair --pairs 2 --max-tokens 64 "${UNITS[@]}"
  retake verify-ops-realistic-pair -- $PY -m benchmarks.verify_ops --model "$Q" \
    --max-width 6 --reps 6 --topic verify-ops-realistic-pair "${UNITS[@]}"
  retake trees-realistic-pair -- $PY -m benchmarks.bench_trees --model "$Q" \
    --arms 3,4,2t3x3,3t2x3,3t2x4 --pairs 2 --max-tokens 64 --topic trees-realistic-pair \
    "${UNITS[@]}"
  retake concurrency-realistic-pair -- $PY -m benchmarks.bench_concurrency --model "$Q" \
    --block-size 3 --levels 1,4,8,16 --max-tokens 64 --topic concurrency-realistic-pair \
    --wait-idle 600
  retake concurrency-realistic-pair-auto -- $PY -m benchmarks.bench_concurrency --model "$Q" \
    --block-size auto --levels 1,4,8,16 --max-tokens 64 \
    --topic concurrency-realistic-pair-auto --wait-idle 600
  retake batch-counts-realistic-pair -- $PY -m benchmarks.bench_batch_counts --model "$Q" \
    --sizes 4,8 --pairs 2 --max-tokens 64 --topic batch-counts-realistic-pair --wait-idle 600
  retake concurrency-c1-realistic-pair-auto -- $PY -m benchmarks.bench_concurrency --model "$Q" \
    --block-size auto --levels 1 --requests 12 --max-tokens 64 \
    --topic concurrency-c1-realistic-pair-auto --wait-idle 600
  retake batch-counts-8-realistic-pair -- $PY -m benchmarks.bench_batch_counts --model "$Q" \
    --sizes 8 --pairs 2 --max-block-size 4 --max-tokens 64 --topic batch-counts-8-realistic-pair \
    --wait-idle 600
  retake prefill-realistic-pair -- $PY -m benchmarks.bench_prefill --model "$Q" \
    --lengths 32,128,512 --pairs 3 --topic prefill-realistic-pair --wait-idle 600
  retake decode-step-realistic-pair -- $PY -m benchmarks.bench_decode_step --model "$Q" \
    --steps 48 --pairs 3 --topic decode-step-realistic-pair --wait-idle 600
  retake draft-processors-realistic-pair-repetition -- $PY -m benchmarks.bench_draft_processors \
    --model "$Q" --topic draft-processors-realistic-pair-repetition --block-sizes 3 --pairs 1 \
    --max-tokens 96 --repetition-penalty 1.1 --unprocessed-drafts "${UNITS[@]}"
  retake draft-processors-realistic-pair-presence -- $PY -m benchmarks.bench_draft_processors \
    --model "$Q" --topic draft-processors-realistic-pair-presence --block-sizes 3 --pairs 1 \
    --max-tokens 96 --presence-penalty 0.5 --unprocessed-drafts "${UNITS[@]}"
  retake conversation-realistic-pair -- $PY -m benchmarks.bench_conversation --model "$Q" \
    --turns 10 --paste-lines 25 --max-tokens 256 --topic conversation-realistic-pair \
    --wait-idle 600
  # about 40 minutes each, most of it the 16k prompts' prefills
  retake long-context-qwen3-5 -- $PY -m benchmarks.bench_long_context --model "$Q" \
    --lengths 1024,4096,16384 --prompts-per-length 1,1,1 --temps 0,0.6 --block-sizes 3 \
    --pairs 1 --max-tokens 48 --topic long-context-qwen3-5 --wait-idle 600
  retake long-context-gemma4 -- $PY -m benchmarks.bench_long_context "${G[@]}" \
    --lengths 1024,4096,16384 --prompts-per-length 1,1,1 --temps 0,0.6 --block-sizes 3 \
    --pairs 1 --max-tokens 48 --topic long-context-gemma4 --wait-idle 600
fi

# The mixture-of-experts pairs, when $REALISTIC_PAIRS holds them (built by
# `python -m benchmarks.realistic_pair $REALISTIC_PAIRS/qwen3_5_moe --moe`, `... qwen3_next
# --family qwen3_next` and `... gemma4_moe --family gemma4 --moe`; docs/benchmarks.md).
if [ -n "${REALISTIC_PAIRS:-}" ] && [ -d "$REALISTIC_PAIRS/qwen3_5_moe" ]; then
  M=$REALISTIC_PAIRS
  retake moe-pair -- $PY -m benchmarks.bench_moe --model "$M/qwen3_5_moe" \
    --dense "$M/qwen3_5_dense" --topic moe-pair --temps 0,0.6 --block-sizes 2,3,4,auto \
    --pairs 1 --max-tokens 96 --synced-runs 1 --wait-idle 600
  retake moe-pair-qwen3-next -- $PY -m benchmarks.bench_moe --model "$M/qwen3_next" \
    --topic moe-pair-qwen3-next --temps 0,0.6 --block-sizes 2,3,4,auto --pairs 1 \
    --max-tokens 64 --synced-runs 1 --wait-idle 600
  retake moe-pair-gemma4 -- $PY -m benchmarks.bench_moe --model "$M/gemma4_moe/target" \
    --drafter "$M/gemma4_moe/assistant" --topic moe-pair-gemma4 --temps 0,0.6 \
    --block-sizes 2,3,4,auto --pairs 1 --max-tokens 64 --synced-runs 1 --wait-idle 600
  retake assistant-bf16-gemma4-moe-pair -- $PY -m benchmarks.bench_assistant_bf16 \
    --model "$M/gemma4_moe/target" --drafter "$M/gemma4_moe/assistant" \
    --topic assistant-bf16-gemma4-moe-pair --block-sizes 3,4 --pairs 2 --max-tokens 64 \
    "${UNITS[@]}"
  # auto against the best fixed blocks in 256-token generations
  retake moe-pair-auto-256 -- $PY -m benchmarks.bench_mtp --model "$M/qwen3_5_moe" \
    --topic moe-pair-auto-256 --block-sizes 3,4,auto --pairs 2 --max-tokens 256 \
    --synced-runs 0 "${UNITS[@]}"
  retake moe-pair-qwen3-next-auto-256 -- $PY -m benchmarks.bench_mtp --model "$M/qwen3_next" \
    --topic moe-pair-qwen3-next-auto-256 --block-sizes 3,4,auto --pairs 2 --max-tokens 256 \
    --synced-runs 0 "${UNITS[@]}"
  retake moe-pair-gemma4-auto-256 -- $PY -m benchmarks.bench_mtp \
    --model "$M/gemma4_moe/target" --drafter "$M/gemma4_moe/assistant" \
    --topic moe-pair-gemma4-auto-256 --block-sizes 3,4,auto --pairs 2 --max-tokens 256 \
    --synced-runs 0 "${UNITS[@]}"
fi

# The realistic Qwen3.5 pair with real token statistics and its draft vocabularies, when
# $REALISTIC_PAIRS holds them (built by `python -m benchmarks.realistic_pair $REALISTIC_PAIRS/zipf
# --zipf 1` and `python -m benchmarks.realistic_zipf $REALISTIC_PAIRS/zipf
# $REALISTIC_PAIRS/zipf-vocab --sizes 8192,16384,32768,65536 --ship 32768`).
if [ -n "${REALISTIC_PAIRS:-}" ]; then
  Z="$REALISTIC_PAIRS/zipf"
  V="$REALISTIC_PAIRS/zipf-vocab"
  retake realistic-zipf-pair-blis -- $PY -m benchmarks.bench_mtp --model "$Z" \
    --topic realistic-zipf-pair-blis --block-sizes 2,3,4,6,auto --pairs 2 --max-tokens 96 \
    --synced-runs 1 "${UNITS[@]}"
  retake realistic-zipf-pair-blis-bf16 -- $PY -m benchmarks.bench_mtp --model "$Z" --draft-bf16 \
    --topic realistic-zipf-pair-blis-bf16 --block-sizes 2,3,4,6,auto --pairs 2 --max-tokens 96 \
    --synced-runs 1 "${UNITS[@]}"
  retake drafter-phases-zipf-pair -- $PY -m benchmarks.bench_drafter --model "$Z" \
    --topic drafter-phases-zipf-pair --block-size 4 --pairs 2 --max-tokens 64 --wait-idle 600
  retake trees-zipf-pair -- $PY -m benchmarks.bench_trees --model "$Z" \
    --arms 3,4,2t3x3,3t2x3,3t2x4 --pairs 2 --max-tokens 64 --topic trees-zipf-pair "${UNITS[@]}"
  retake draft-vocab-zipf-pair -- $PY -m benchmarks.bench_draft_vocab --model "$Z" \
    --draft-vocabs "$V/8192" "$V/16384" "$V/32768" "$V/65536" --block-sizes 3,4 --pairs 2 \
    --max-tokens 64 --topic draft-vocab-zipf-pair "${UNITS[@]}"
fi
