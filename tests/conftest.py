"""Shared fixtures. Keep this small: test modules own their specific data."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import deeppart

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_MANIFEST = ROOT / "examples" / "manifest.json"

# ``bench`` (model-shaped manifests) is importable from the tests.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


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
