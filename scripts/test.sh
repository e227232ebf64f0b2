#!/usr/bin/env bash
# Runs every test: Rust (cargo test, property tests), lint and types
# (ruff, mypy), and Python (pytest, including multi-rank MPI tests).
# Sets up .venv and the extension first; skips what is already done.
# --quick: lint, types and the single-process tests only (no Rust tests, no
# multi-rank or slow tests), for a change that touches one part.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
setup
if [ "${1:-}" = "--quick" ]; then
  shift
  log "quick subset: ruff, mypy, single-process pytest (the whole suite: without --quick)"
  ruff check deeppart tests bench
  mypy
  exec pytest -q -m "not mpi and not multirank and not slow" "$@"
fi
log "Rust format and tests"
cargo fmt --all --check
cargo test -p deeppart-planner -p deeppart-io --release --quiet
log "ruff"
ruff check deeppart tests bench
log "mypy"
mypy
log "docs site (mkdocs build --strict)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
log "pytest"
# Unbuffered, as CI runners often run Python: the workers' report lines
# (tests/support/rank_output.py) must stay whole when every rank prints at once.
export PYTHONUNBUFFERED=1
# Real-FTI tests (tests/levels/test_fti.py): run with $FTI_LIBRARY, else .fti/ (scripts/build-fti.sh).
if [ -z "${FTI_LIBRARY:-}" ] && [ -f .fti/lib/libfti.so ]; then export FTI_LIBRARY="$PWD/.fti/lib/libfti.so"; fi
[ -n "${FTI_LIBRARY:-}" ] || log "real-FTI tests skipped: no libfti (build it: bash scripts/build-fti.sh FTI_SOURCE_DIR, or set FTI_LIBRARY)"
# The multi-node harness (tests/levels/test_cluster.py) needs root and namespaces.
why=$(python tests/support/cluster.py)
[ -z "$why" ] || log "multi-node harness (tests/levels/test_cluster.py) skipped: $why"
pytest -q "$@"
