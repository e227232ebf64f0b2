"""The storage layer: where checkpoints are written and read.

- :mod:`deeppart.storage.base`: the interface, :class:`ObjectStore` (named
  objects under a root: get, ranged read, conditional put, streaming
  writer, list, delete) and :class:`RangeReader` (a seekable file over one
  object).
- :mod:`deeppart.storage.local`: :class:`LocalStore`, a directory.
- :mod:`deeppart.storage.s3`: :class:`S3Store`, ``s3://bucket/prefix``
  through ``obstore`` (configuration from the ``AWS_*`` environment, and
  from the AWS shared files: :mod:`deeppart.storage.aws_profile`).
- :mod:`deeppart.storage.url`: :func:`parse_location` (a path, an
  :class:`S3URL`, or :class:`~deeppart.errors.UnsupportedURLError`).
- :mod:`deeppart.storage.objects`: checkpoints in an object store (the
  commit marker put last and conditionally; cleanup by save id and content;
  :func:`open_committed` for loads).
- :mod:`deeppart.storage.target`: :class:`SaveTarget`, what the save's
  stages call on a file system (:class:`LocalTarget`, :mod:`deeppart.storage.commit`)
  or an object store (:class:`ObjectTarget`).
- :mod:`deeppart.storage.source`: :class:`CheckpointSource`, what reads
  a checkpoint asks (:func:`checkpoint_source`: a :class:`LocalSource`
  directory or an :class:`ObjectSource` prefix); outside this package no
  module tells a path from a URL.

:func:`open_store` gives the store of a path or URL.
"""

from __future__ import annotations

import os

from deeppart.storage.base import ObjectExistsError, ObjectInfo, ObjectStore, RangeReader
from deeppart.storage.url import S3URL, SCHEMES, is_url, parse_location, parse_s3_url

__all__ = [
    "S3URL",
    "SCHEMES",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectStore",
    "RangeReader",
    "is_url",
    "open_store",
    "parse_location",
    "parse_s3_url",
]


def open_store(location: str | os.PathLike[str] | S3URL) -> ObjectStore:
    """The :class:`ObjectStore` rooted at ``location``: an
    :class:`~deeppart.storage.s3.S3Store` for ``s3://bucket/prefix``, a
    :class:`~deeppart.storage.local.LocalStore` for a path; other URLs
    raise :class:`~deeppart.errors.UnsupportedURLError`."""
    where = location if isinstance(location, S3URL) else parse_location(location)
    if isinstance(where, S3URL):
        from deeppart.storage.s3 import S3Store

        return S3Store(where)
    from deeppart.storage.local import LocalStore

    return LocalStore(where)
