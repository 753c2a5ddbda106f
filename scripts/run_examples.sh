#!/usr/bin/env bash
# Runs the README's three example commands with a few steps each and prints their wall time.
set -euo pipefail
steps=${STEPS:-20}
TIMEFORMAT='took %Rs'
for args in "" "strategy=hybrid mesh.data=2 mesh.model=4" "strategy=model_parallel mesh.model=8"; do
    echo "python -m training.run $args"
    # shellcheck disable=SC2086
    time python -m training.run $args trainer.steps="$steps" | grep -E '^(summary|final loss)'
    echo
done
