"""The read side's storage seam (deeppart/storage/source.py, issue 45): a
checkpoint's source is chosen once from its location, and its two backends
(a directory, an S3 prefix on a real S3-protocol server: moto's, the
``s3_url`` fixture of tests/conftest.py) answer alike; and no module
outside ``deeppart/storage/`` tells storage kinds apart by ``isinstance``
(an AST scan of the package)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import deeppart
from deeppart.errors import CheckpointError, UnsupportedURLError
from deeppart.format import MARKER, data_file_name, decode_metadata
from deeppart.storage.files import data_file, local_dir
from deeppart.storage.source import (
    CheckpointSource,
    LocalSource,
    ObjectSource,
    checkpoint_source,
)
from deeppart.storage.url import S3URL

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deeppart"

#: The types that name a kind of storage: a check of one of them is the
#: storage layer's business (deeppart/storage/), nobody else's.
STORAGE_KINDS = {
    "Path",
    "PurePath",
    "PosixPath",
    "S3URL",
    "Location",
    "ObjectDir",
    "CheckpointDir",
    "LocalFile",
    "StoredFile",
    "ObjectStore",
    "LocalStore",
    "S3Store",
    "SaveTarget",
    "LocalTarget",
    "ObjectTarget",
    "CheckpointSource",
    "LocalSource",
    "ObjectSource",
}


def state() -> dict[str, object]:
    return {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(5), "step": 3}


@pytest.fixture(params=["directory", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A checkpoint's location, not yet written: a directory, or a prefix
    of a fresh bucket on the session's S3 server."""
    if request.param == "directory":
        yield str(tmp_path / "run" / "step-3")
    else:
        yield f"{request.getfixturevalue('s3_url')}/run/step-3"


def test_both_backends_answer_alike(location: str) -> None:
    source = checkpoint_source(location)
    in_store = location.startswith("s3://")
    assert isinstance(source, ObjectSource if in_store else LocalSource)
    assert str(source) == location
    # Nothing there yet: not committed, nothing to open, no data file.
    assert not source.is_committed()
    with pytest.raises(CheckpointError):
        source.open_committed()
    assert source.committed_file(data_file_name(0), 1, deep=True) == (False, None)

    deeppart.save(state(), location)
    assert source.is_committed()
    at, text = source.open_committed()
    assert source.committed_metadata() == text
    assert source.open_for_load() == (at, text)
    assert source.open_written() == (at, text, True)
    meta = decode_metadata(text)
    size = int(meta["file_sizes"][0])
    assert meta["world_size"] == 1 and size > 0

    # The data file: the same bytes through the seam and through the reader's file.
    name = data_file_name(0)
    with data_file(at, name).open() as f:
        stored = f.read(size)
    assert len(stored) == size
    found, buf = source.committed_file(name, size, deep=True)
    assert found and buf is not None and buf.tobytes() == stored
    assert source.committed_file(name, size, deep=False) == (True, None)
    assert source.committed_file(name, size + 1, deep=False) == (False, None)
    assert source.committed_file(name, size + 1, deep=True)[1] is None
    assert source.committed_file(data_file_name(7), 10, deep=False) == (False, None)

    # The backend's own handles: a directory, or a store and no cache.
    if in_store:
        assert source.local_dir() is None and local_dir(at) is None
        store = source.object_store()
        assert store is not None and store.url == location
        assert not source.rereads_cached
    else:
        assert source.local_dir() == Path(location) == local_dir(at)
        assert source.object_store() is None
        assert source.rereads_cached
    assert torch.equal(deeppart.load(location)["w"], torch.arange(3000, dtype=torch.float32))


def test_an_uncommitted_directory_opens_as_written(tmp_path: Path) -> None:
    """What ``deeppart inspect`` reads: the metadata of a save that never
    committed, marked so (in an object store nothing uncommitted is found)."""
    d = tmp_path / "ckpt"
    deeppart.save(state(), d)
    (d / MARKER).unlink()
    source = checkpoint_source(d)
    at, text, committed = source.open_written()
    assert at == d and not committed and decode_metadata(text)["world_size"] == 1
    assert not source.is_committed()
    with pytest.raises(CheckpointError, match="never committed"):
        source.open_committed()


def test_chosen_once_from_the_location() -> None:
    """Parsing stays in one place: a path, a URL, a parsed location or a
    source; other schemes refused as the save and load refuse them; an
    object store's source reads no configuration until it is used."""
    url = S3URL("bucket", "run/step-1")
    source = checkpoint_source(url)
    assert isinstance(source, ObjectSource) and source.location == url
    assert source.local_dir() is None
    assert checkpoint_source("s3://bucket/run/step-1").location == url
    assert checkpoint_source(source) is source
    assert checkpoint_source(Path("a/b")).local_dir() == Path("a/b")
    with pytest.raises(UnsupportedURLError, match="gs://"):
        checkpoint_source("gs://bucket/run")
    assert isinstance(source, CheckpointSource)


# ----------------------------------------------------------------------------
# No storage-kind checks outside deeppart/storage/.


def storage_kind_checks(source: str) -> list[tuple[int, str]]:
    """``isinstance``/``issubclass`` calls and ``case`` class patterns in
    ``source`` whose class names a kind of storage (:data:`STORAGE_KINDS`):
    line and text of each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.MatchClass):  # case S3URL(): ...
            cls = node.cls
            name = cls.id if isinstance(cls, ast.Name) else getattr(cls, "attr", "")
            if name in STORAGE_KINDS:
                found.append((node.lineno, ast.unparse(node)))
            continue
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            continue
        named = {
            n.id if isinstance(n, ast.Name) else n.attr
            for n in ast.walk(node.args[1])
            if isinstance(n, ast.Name | ast.Attribute)
        }
        if named & STORAGE_KINDS:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_a_planted_check() -> None:
    planted = (
        "from pathlib import Path\n"
        "def f(where):\n"
        "    if isinstance(where, Path | str):\n"
        "        return 1\n"
        "    return isinstance(where, storage.url.S3URL)\n"
    )
    assert [line for line, _ in storage_kind_checks(planted)] == [3, 5]
    matched = "match where:\n    case S3URL(bucket=b):\n        pass\n    case str():\n        pass"
    assert [line for line, _ in storage_kind_checks(matched)] == [2]
    assert storage_kind_checks("isinstance(x, os.PathLike)\nisinstance(y, int)\n") == []


def test_no_storage_kind_check_outside_the_storage_layer() -> None:
    storage = PACKAGE / "storage"
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if storage not in path.parents
        for line, text in storage_kind_checks(path.read_text())
    ]
    assert offenders == [], (
        "storage kinds are told apart in deeppart/storage/ only (ask the location's "
        "CheckpointSource or SaveTarget instead):\n" + "\n".join(offenders)
    )
    # The scan sees the storage layer's own checks, which are allowed there.
    assert storage_kind_checks((storage / "source.py").read_text())
