"""Options of ``deeppart serve``, importable without grpcio."""

from __future__ import annotations

import argparse

SERVICE_NAME = "deeppart.planner.v1.Planner"
JOB_METADATA_KEY = "x-deeppart-job"
TOKEN_ENV = "DEEPPART_TOKEN"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_RESPONSE_CACHE_BYTES = 256 * 1024 * 1024
#: Disk for uploaded manifests (and a sixteenth more for plans' parameters).
DEFAULT_STORE_BYTES = 4 * 1024 * 1024 * 1024


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:7777", help="HOST:PORT (port 0: any free one)")
    p.add_argument("--cache-dir", required=True, help="manifests and plans persist here")
    p.add_argument(
        "--token-file",
        help=f"require this bearer token (else ${TOKEN_ENV} if set; never on the command line)",
    )
    p.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key: serve TLS)")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument(
        "--response-cache-bytes",
        type=int,
        default=DEFAULT_RESPONSE_CACHE_BYTES,
        help="memory for serialized responses of recently used plans",
    )
    p.add_argument(
        "--store-bytes",
        type=int,
        default=DEFAULT_STORE_BYTES,
        help="disk for uploaded manifests, least recently used out (plans' parameters "
        "get a sixteenth more) [4 GiB]",
    )
    p.add_argument("--workers", type=int, default=32, help="RPC threads")
    p.add_argument("--grace-s", type=float, default=30.0, help="on SIGTERM, in-flight RPCs' limit")
    p.add_argument(
        "--drain-delay-s",
        type=float,
        default=0.0,
        help="on SIGTERM, keep serving this long with health NOT_SERVING first",
    )
    p.add_argument("--port-file", help="write the port listened on to this file when ready")
    p.add_argument("--log-file", help="JSON-lines log (default: stderr)")
    p.add_argument("--test-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
