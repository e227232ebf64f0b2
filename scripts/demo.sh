#!/usr/bin/env bash
# The main job: data-parallel training on 4 MPI ranks with DeepPart
# checkpoints, a simulated crash mid-save, a restart from the latest committed
# checkpoint, and a bitwise check against an uninterrupted run (deeppart/tools/demo.py).
# Sets up .venv and the extension first; skips what is already done.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
setup
log "deeppart demo: 4 ranks (mpiexec), checkpoint, crash, restore, verify"
deeppart demo --ranks 4 "$@"
