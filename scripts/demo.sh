#!/usr/bin/env bash
# The main job. Sets up .venv and the extension first; skips what is already done.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
setup
for algorithm in balanced lpt greedy deeppart; do
  log "planning examples/manifest.json for 4 ranks with $algorithm"
  deeppart plan examples/manifest.json --world-size 4 --algorithm "$algorithm"
done
