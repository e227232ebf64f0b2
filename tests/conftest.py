"""Shared fixtures. Keep this small: test modules own their specific data."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deeppart

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_MANIFEST = ROOT / "examples" / "manifest.json"

# ``bench`` (model-shaped manifests) is importable from the tests, and so
# are the helpers every folder shares (tests/support/: launching,
# mpi_checkpoint, rank_output, s3_server, thread_comm, cluster).
SUPPORT = ROOT / "tests" / "support"
for path in (ROOT, SUPPORT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session", autouse=True)
def _isolated_plan_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """deeppart.plan's default cache lives in a temporary directory, never in
    the user's ~/.cache, for the whole session (subprocesses inherit it)."""
    old = os.environ.get("DEEPPART_CACHE_DIR")
    os.environ["DEEPPART_CACHE_DIR"] = str(tmp_path_factory.mktemp("plan-cache"))
    yield
    if old is None:
        del os.environ["DEEPPART_CACHE_DIR"]
    else:
        os.environ["DEEPPART_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def example_manifest() -> deeppart.Manifest:
    """examples/manifest.json: tensors, an object leaf and an owned leaf."""
    return deeppart.Manifest.from_json(EXAMPLE_MANIFEST.read_text())


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A moto S3 server on 127.0.0.1 (tests/support/s3_server.py), for the whole
    session; killed at the end. Skips when moto is not installed."""
    from s3_server import S3Server, moto_command

    if moto_command() is None:
        pytest.skip("moto[server] is not installed (requirements/dev.txt pins it)")
    server = S3Server(tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


_buckets = itertools.count()


@pytest.fixture
def s3_url(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://BUCKET`` of a fresh bucket on the session's server, with the
    ``AWS_*`` variables that reach it set for this test."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):  # not the developer's
        monkeypatch.delenv(key, raising=False)
    return str(s3_server.make_bucket(f"deeppart-{os.getpid()}-{next(_buckets)}"))
