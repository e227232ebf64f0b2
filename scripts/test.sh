#!/usr/bin/env bash
# Runs every test: Rust (cargo test, property tests), lint and types
# (ruff, mypy), and Python (pytest, including multi-rank MPI tests).
# Sets up .venv and the extension first; skips what is already done.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
setup
log "Rust format and tests"
cargo fmt --all --check
cargo test -p deeppart-planner --release --quiet
log "ruff"
ruff check deeppart tests bench
log "mypy"
mypy
log "pytest"
pytest -q "$@"
