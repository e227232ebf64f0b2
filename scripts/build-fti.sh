#!/usr/bin/env bash
# Builds libfti (github.com/leobago/fti, v1.6) from a source tree you already
# have, with the virtualenv's MPI compiler wrappers, into .fti/ (git-ignored),
# and checks that it links the same libmpi as mpi4py. Never downloads.
#
#   bash scripts/build-fti.sh FTI_SOURCE_DIR
#
# Needs cmake, OpenSSL and zlib headers (Debian: apt-get install -y cmake
# libssl-dev zlib1g-dev) and .venv with mpi4py + the mpich wheel.
# Prints the FTI_LIBRARY= line to export; scripts/test.sh finds .fti/ itself.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PREFIX="$ROOT/.fti"

die() { printf '[build-fti] error: %s\n' "$*" >&2; exit 1; }
log() { printf '[build-fti] %s\n' "$*" >&2; }

[ $# -eq 1 ] || die "usage: bash scripts/build-fti.sh FTI_SOURCE_DIR (a checkout of github.com/leobago/fti v1.6)"
SRC="$(cd "$1" 2>/dev/null && pwd)" || die "$1: no such directory"
[ -f "$SRC/CMakeLists.txt" ] && [ -f "$SRC/include/fti.h" ] \
  || die "$SRC does not look like FTI's source tree (no CMakeLists.txt or include/fti.h)"
grep -q 'project("FTI"' "$SRC/CMakeLists.txt" || die "$SRC/CMakeLists.txt is not FTI's"
command -v cmake >/dev/null || die "cmake not found (apt-get install -y cmake libssl-dev zlib1g-dev)"
MPICC="$VENV/bin/mpicc"
MPICXX="$VENV/bin/mpicxx"
PY="$VENV/bin/python"
[ -x "$MPICC" ] && [ -x "$MPICXX" ] || die "$VENV/bin/mpicc or mpicxx missing: create .venv first (source scripts/env.sh && setup)"

# mpi4py's MPI library: the one libfti must link.
MPI4PY_LIB="$("$PY" - <<'EOF'
import os
from mpi4py import MPI  # noqa: F401  (maps libmpi)
for line in open("/proc/self/maps"):
    path = line.split(None, 5)[-1].strip()
    if os.path.basename(path).startswith(("libmpi.so", "libmpich.so")):
        print(os.path.realpath(path))
        break
EOF
)"
[ -n "$MPI4PY_LIB" ] || die "could not find the MPI library mpi4py loads"
log "mpi4py uses $MPI4PY_LIB"

BUILD="$PREFIX/build"
rm -rf "$BUILD"
mkdir -p "$BUILD"
log "configuring FTI from $SRC (version $(cat "$SRC/VERSION" 2>/dev/null || echo '?'))"
# FTI's project() enables C and C++, and its own FindMPI looks for both
# wrappers; Fortran, examples, tests, HDF5, SIONlib and docs stay off.
cmake -S "$SRC" -B "$BUILD" \
  -DCMAKE_C_COMPILER="$MPICC" -DCMAKE_CXX_COMPILER="$MPICXX" \
  -DMPI_C_COMPILER="$MPICC" -DMPI_CXX_COMPILER="$MPICXX" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$PREFIX" \
  -DENABLE_FORTRAN=OFF -DENABLE_EXAMPLES=OFF -DENABLE_TESTS=OFF -DENABLE_TUTORIAL=OFF \
  -DENABLE_HDF5=OFF -DENABLE_SIONLIB=OFF -DENABLE_DOCU=OFF >"$BUILD/cmake.log" 2>&1 \
  || { tail -30 "$BUILD/cmake.log" >&2; die "cmake failed (full log: $BUILD/cmake.log)"; }
log "building (make -j$(nproc))"
make -C "$BUILD" -j"$(nproc)" >"$BUILD/make.log" 2>&1 \
  || { tail -30 "$BUILD/make.log" >&2; die "make failed (full log: $BUILD/make.log)"; }
make -C "$BUILD" install >>"$BUILD/make.log" 2>&1 || die "make install failed ($BUILD/make.log)"

LIB=""
for d in lib lib64; do
  [ -f "$PREFIX/$d/libfti.so" ] && LIB="$PREFIX/$d/libfti.so" && break
done
[ -n "$LIB" ] || die "no libfti.so under $PREFIX/lib after make install"
if [ "$LIB" != "$PREFIX/lib/libfti.so" ]; then
  mkdir -p "$PREFIX/lib" && ln -sf "$LIB" "$PREFIX/lib/libfti.so"
  LIB="$PREFIX/lib/libfti.so"
fi

# ldd: libfti must resolve libmpi to mpi4py's library, and nothing else.
LDD="$(ldd "$LIB")"
if grep -q "not found" <<<"$LDD"; then
  die "ldd $LIB: unresolved libraries: $(grep "not found" <<<"$LDD" | tr -s ' \t\n' ' ')"
fi
LINKED="$(awk '/libmpi|libmpich/ {print $3}' <<<"$LDD")"
[ -n "$LINKED" ] || die "ldd $LIB shows no MPI library"
for l in $LINKED; do
  [ "$(realpath "$l")" = "$MPI4PY_LIB" ] \
    || die "$LIB links $l, but mpi4py uses $MPI4PY_LIB: rebuild with that MPI's wrappers"
done
log "ldd: libfti links $(echo "$LINKED" | tr '\n' ' ')(the same as mpi4py)"
echo "FTI_LIBRARY=$LIB"
