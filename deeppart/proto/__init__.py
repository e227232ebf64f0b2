"""Generated protobuf and gRPC modules of deeppart.planner.v1 (scripts/gen_proto.sh).

Do not edit: regenerate from proto/deeppart/planner/v1/planner.proto.
"""
