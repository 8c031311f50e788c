#!/usr/bin/env bash
# Every training run the seed-level verdicts need (issue 33), in priority order. Each step is
# resumable and additive (a finished row is kept, a killed one redone), so running this again
# continues where it stopped; a failed step is reported and the next one runs. While
# $PAUSE_FILE exists (default /tmp/efficient_lm_quiet) the running row is stopped (SIGSTOP).
#
# Run it from a frozen copy of a commit, so later edits do not change the running code:
#   git worktree add /work/science-run <commit> && cd /work/science-run
#   nohup nice -n 19 bash experiments/seed_level_runs.sh > run.log 2>&1 &
# At any point, from the results there (partial ones included):
#   python -m experiments.verdicts      # results/verdicts.json and experiments/README.md's tables
set -u
cd "$(dirname "$0")/.."
PAUSE="--pause_file=${PAUSE_FILE:-/tmp/efficient_lm_quiet}"
ABLATION=honly,bcmt,dense,pi_attention,sliding_window,ecp,perceiver_ar  # HOnly, BCMT first: the sanity check

step() {
  echo "=== $(date -u +%FT%TZ) start: $*"
  nice -n 19 python -m "$@" "$PAUSE" || echo "=== $(date -u +%FT%TZ) FAILED (status $?): $*"
}
rows() {  # rows MODEL,MODEL SEED SEED ... -> model@seed,... (seed-major)
  local models=$1 out=() s m; shift
  for s in "$@"; do for m in ${models//,/ }; do out+=("$m@$s"); done; done
  local IFS=,; echo "${out[*]}"
}

# 1. The swap ablation on the plays, seed 0, HOnly and BCMT first (the sanity check).
step experiments.context_ablation --seeds=0 --corpora=shakespeare --models=$ABLATION
# 2. Recall: ECP and Perceiver-AR at 4 layers (a path to every judged query), 5 seeds.
step experiments.long_range --rows="$(rows ecp_4layers,perceiver_ar_4layers 0 1 2 3 4)"
# 3. Recall: seeds 2-4 of the families the recall claims compare.
step experiments.long_range --rows="$(rows pi_attention,sliding_window,bcmt,honly,dense 2 3 4)"
# 4. The swap ablation: the code corpus, then seeds 1 and 2 on both corpora.
step experiments.context_ablation --seeds=0,1,2 --corpora=shakespeare,python_code --models=$ABLATION
# 5. The paper tables: the confounds (π with a fixed gate, π's gate without skips, Perceiver-AR
#    with ECP's FLOPs), then every row's third seed.
step experiments.paper_tables --tables=pi,ecp --workdir_root=runs/paper_tables \
  --models=pi_attention+fixed_gate,pi_attention+no_skips,perceiver_ar+ecp_flops
step experiments.paper_tables --workdir_root=runs/paper_tables
# 6. Recall: the rest of the matrix (ECP and Perceiver-AR at 2 layers, seeds 2-4) and π seed 1
#    trained to 3,000 steps.
step experiments.long_range --rows="$(rows ecp,perceiver_ar 2 3 4),pi_attention_3000steps@1"
step experiments.long_range
echo "=== $(date -u +%FT%TZ) done"
