# Shared set-up for the README's commands; source it, don't run it.
# Creates .venv, installs the pinned dependencies and builds the Rust
# extension, each step skipped when its inputs have not changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

log() { printf '\033[1m[deeppart]\033[0m %s\n' "$*" >&2; }

hash_of() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

ensure_venv() {
  if [ ! -x "$PY" ]; then
    log "creating virtualenv at .venv"
    python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
  fi
  local want; want="$(hash_of requirements/dev.txt)"
  if [ "$(cat "$VENV/.deps-stamp" 2>/dev/null)" != "$want" ]; then
    log "installing pinned dependencies (torch is large: the first time takes a few minutes)"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -r requirements/dev.txt
    echo "$want" > "$VENV/.deps-stamp"
  fi
}

ensure_build() {
  local want
  want="$(hash_of Cargo.toml Cargo.lock pyproject.toml planner/Cargo.toml io/Cargo.toml bindings/Cargo.toml \
    $(find planner/src io/src bindings/src -name '*.rs' | sort))"
  if [ "$(cat "$VENV/.build-stamp" 2>/dev/null)" != "$want" ] || ! ls deeppart/_planner*.so >/dev/null 2>&1; then
    log "building the Rust planner extension (maturin develop --release)"
    # maturin's pip lists every optional dependency whose extra is not asked
    # for ("Ignoring zstandard: markers 'extra == ...' don't match your
    # environment"): drop exactly those lines; everything else, errors
    # included, passes, and pipefail keeps maturin's exit status.
    VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" "$VENV/bin/maturin" develop --release --quiet 2>&1 \
      | { grep -v -E "^Ignoring [^ ]+: markers '[^']*' don't match your environment$" || true; } >&2
    echo "$want" > "$VENV/.build-stamp"
  fi
}

setup() {
  ensure_venv
  ensure_build
  export PATH="$VENV/bin:$PATH"
  export VIRTUAL_ENV="$VENV"
}
