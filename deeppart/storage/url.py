"""Where a checkpoint lives: a file system path or an ``s3://`` URL.

:func:`parse_location` is the one place that tells them apart for the
stages that serve both (``save``, ``load``, ``async_save``): a path comes
back as a :class:`~pathlib.Path`; ``s3://bucket/prefix`` as an
:class:`S3URL`; any other ``scheme://`` (``gs://``, ``file://``, ...) raises
:class:`~deeppart.errors.UnsupportedURLError` naming the schemes served.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from deeppart.errors import UnsupportedURLError

__all__ = [
    "S3URL",
    "SCHEMES",
    "Location",
    "is_url",
    "location_key",
    "parse_location",
    "parse_s3_url",
]

#: The URL schemes DeepPart reads and writes.
SCHEMES = ("s3",)

#: ``scheme://`` or ``scheme:/`` (the form ``Path`` makes of a URL); a
#: scheme has two letters or more, so no Windows drive (``C:/``) matches.
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/")
#: S3's bucket naming rules (3-63 characters of lower-case letters, digits,
#: dots and hyphens, beginning and ending with a letter or digit).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class S3URL:
    """``s3://bucket/prefix``: the prefix has no leading or trailing ``/``
    (``""`` for the bucket's root)."""

    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __truediv__(self, name: str) -> S3URL:
        """The location ``name`` under this one, as ``Path / name`` is for a
        directory: ``S3URL("b", "run") / "step-1"`` is ``s3://b/run/step-1``;
        UnsupportedURLError for an empty, ``.`` or ``..`` segment."""
        name = name.strip("/")
        if any(part in ("", ".", "..") for part in name.split("/")):
            raise UnsupportedURLError(
                f"{self}/{name}: empty, '.' or '..' path segments are not allowed"
            )
        return S3URL(self.bucket, f"{self.prefix}/{name}" if self.prefix else name)


#: A checkpoint's location as the save and load stages take it.
Location = Path | S3URL


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is written as a URL (``scheme://...``)."""
    return _URL.match(os.fsdecode(os.fspath(path))) is not None


def parse_s3_url(text: str) -> S3URL:
    """``s3://bucket/a/b`` as an :class:`S3URL`; UnsupportedURLError for
    a malformed one (no bucket, a bad bucket name, empty path segments)."""
    if not text.startswith("s3://"):
        raise UnsupportedURLError(f"{text}: not an s3:// URL")
    bucket, _, prefix = text[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if _BUCKET.fullmatch(bucket) is None:
        raise UnsupportedURLError(
            f"{text}: {bucket!r} is not an S3 bucket name (3-63 characters: lower-case "
            "letters, digits, '.' and '-')"
        )
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UnsupportedURLError(f"{text}: empty, '.' or '..' path segments are not allowed")
    return S3URL(bucket, prefix)


def parse_location(path: str | os.PathLike[str] | S3URL) -> Path | S3URL:
    """A checkpoint location: a local path as :class:`~pathlib.Path`, an
    ``s3://`` URL as :class:`S3URL` (one already parsed as itself); other
    URLs raise :class:`~deeppart.errors.UnsupportedURLError`."""
    if isinstance(path, S3URL):
        return path
    text = os.fsdecode(os.fspath(path))
    m = _URL.match(text)
    if m is None:
        return Path(text)
    scheme = m.group(1).lower()
    if scheme == "s3" and text.startswith("s3://"):
        return parse_s3_url(text)
    raise UnsupportedURLError(
        f"{text}: a {m.group(1)}:// URL; DeepPart reads and writes file system paths "
        f"and {', '.join(s + '://' for s in SCHEMES)} URLs only"
        + (" (for a file:// URL pass the path itself)" if scheme == "file" else "")
        + (" (write s3://bucket/prefix)" if scheme == "s3" else "")
    )


def location_key(location: Path | S3URL) -> str:
    """The text by which ranks compare a save's location: the absolute
    path, or the URL."""
    return str(location) if isinstance(location, S3URL) else os.path.abspath(location)
