#!/usr/bin/env bash
# Regenerates deeppart/proto/ from proto/deeppart/planner/v1/planner.proto with
# grpcio-tools (pinned in requirements/dev.txt). The generated files are
# committed; run this after every change to the .proto and commit the result.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
OUT="$ROOT/deeppart/proto"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

"$PY" -m grpc_tools.protoc -I proto \
  --python_out="$TMP" --pyi_out="$TMP" --grpc_python_out="$TMP" \
  proto/deeppart/planner/v1/planner.proto

# protoc lays the modules out by proto package (deeppart/planner/v1/); they
# live flat in deeppart/proto/, so fix the one cross-module import. The
# descriptor keeps its proto name, deeppart/planner/v1/planner.proto, which
# is what server reflection serves.
GEN="$TMP/deeppart/planner/v1"
sed -i 's/^from deeppart\.planner\.v1 import planner_pb2 as/from deeppart.proto import planner_pb2 as/' \
  "$GEN/planner_pb2_grpc.py"
mkdir -p "$OUT"
cp "$GEN/planner_pb2.py" "$GEN/planner_pb2.pyi" "$GEN/planner_pb2_grpc.py" "$OUT/"
cat > "$OUT/__init__.py" <<'PYEOF'
"""Generated protobuf and gRPC modules of deeppart.planner.v1 (scripts/gen_proto.sh).

Do not edit: regenerate from proto/deeppart/planner/v1/planner.proto.
"""
PYEOF
echo "generated $(ls "$OUT" | tr '\n' ' ')"
