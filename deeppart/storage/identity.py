"""Which store each rank of a save addresses, compared before anything is
written, and the commit's proof that the store holds what every rank wrote.

Every rank resolves its store from its own environment (an ``s3://`` URL:
the endpoint, region and addressing from its ``AWS_*`` variables and AWS
profile), so one misconfigured node can write its data file somewhere the
commit never looks. Each rank describes the store it resolved as an
:data:`Identity` (:meth:`deeppart.storage.target.SaveTarget.identity`:
for S3 the normalised endpoint, the region, bucket, key prefix and
addressing style); the save's prepare agreement carries a 16-byte digest
of it (:func:`identity_digest`) in the row every rank sends anyway. Only
when the digests differ, one more collective gathers the identities and
every rank raises the same :class:`~deeppart.errors.StoreConfigError`,
naming each setting that differs and which ranks have which value
(:func:`identity_error`).

The comparison is of settings, not a proof: two names of one server
differ, and one name (``localhost``) can reach a different server on each
node. The proof is the commit's: before it commits, rank 0 checks that
every data file the metadata names is in the store it commits to, with
the size its rank wrote (:meth:`~deeppart.storage.target.SaveTarget.
check_written`, :func:`check_written`); else every rank raises and
nothing is committed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from urllib.parse import urlsplit

from deeppart.errors import StoreConfigError
from deeppart.format import data_file_name

__all__ = [
    "IDENTITY_BYTES",
    "Identity",
    "check_written",
    "identity_digest",
    "identity_error",
    "identity_text",
    "normalise_endpoint",
    "ranks_text",
]

#: The length of :func:`identity_digest`.
IDENTITY_BYTES = 16

#: A store as one rank resolved it: setting name -> value, in a fixed order.
Identity = dict[str, str]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalise_endpoint(url: str) -> str:
    """``url`` as the ranks compare it: scheme and host in lower case, the
    scheme's default port and a trailing ``/`` dropped
    (``HTTPS://S3.example.com:443/`` is ``https://s3.example.com``); the
    text itself (stripped) if it is not a URL."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        return text
    if not parts.scheme or not parts.hostname:
        return text
    scheme = parts.scheme.lower()
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address
    if port is not None and port != _DEFAULT_PORTS.get(scheme):
        host += f":{port}"
    return f"{scheme}://{host}{parts.path.rstrip('/')}"


def identity_text(identity: Identity) -> bytes:
    """``identity`` as the bytes the ranks digest and, on a mismatch, send."""
    return json.dumps(identity, separators=(",", ":")).encode()


def identity_digest(text: bytes) -> bytes:
    """:data:`IDENTITY_BYTES` of :func:`identity_text`'s ``text``."""
    return hashlib.blake2b(text, digest_size=IDENTITY_BYTES).digest()


def ranks_text(ranks: Sequence[int], most: int = 8) -> str:
    """``ranks [0, 2]``, or ``ranks [0, 1, ..., 7] and 24 more`` for a long list."""
    shown = list(ranks[:most])
    more = f" and {len(ranks) - most} more" if len(ranks) > most else ""
    return f"rank {shown[0]}" if len(ranks) == 1 else f"ranks {shown}{more}"


def identity_error(texts: Sequence[bytes]) -> StoreConfigError:
    """The error for ranks whose identities (``texts[r]``: rank r's
    :func:`identity_text`) differ: each differing setting with the ranks
    that have each value."""
    per_rank: list[Identity] = []
    for t in texts:
        try:
            per_rank.append(json.loads(t.decode()) if t else {})
        except ValueError:
            per_rank.append({"store": t.decode("utf-8", "replace")})
    names: list[str] = []
    for ident in per_rank:
        names += [k for k in ident if k not in names]
    parts = []
    for name in names:
        by: dict[str, list[int]] = {}
        for r, ident in enumerate(per_rank):
            by.setdefault(ident.get(name, "(none)"), []).append(r)
        if len(by) > 1:
            values = sorted(by.items(), key=lambda kv: kv[1][0])
            parts.append(
                f"{name}: " + ", ".join(f"{ranks_text(rs)} {v}" for v, rs in values[:4])
                + (f" and {len(values) - 4} other values" if len(values) > 4 else "")
            )  # fmt: skip
    hint = ""
    if "endpoint" in names:
        hint = (
            ". Give every rank the same AWS_ENDPOINT_URL, AWS_REGION, "
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST and AWS_PROFILE (or, where each node reaches one "
            "store through its own endpoint, the same DEEPPART_S3_STORE_ID on every rank)"
        )
    return StoreConfigError(
        f"the ranks do not address one store ({'; '.join(parts) or 'they differ'}); "
        f"nothing was written{hint}"
    )


def check_written(where: str, seen: Sequence[int | None], sizes: Sequence[int]) -> None:
    """Rank 0, before its commit: raises StoreConfigError naming the ranks
    whose data file is missing from ``where`` (``seen[r]`` None) or has
    another size there than rank r wrote (``sizes[r]``, the metadata's)."""
    bad = [r for r, (got, size) in enumerate(zip(seen, sizes, strict=True)) if got != size]
    if not bad:
        return
    shown = ", ".join(
        f"{data_file_name(r)} "
        + ("missing" if seen[r] is None else f"has {seen[r]} bytes, {sizes[r]} written")
        for r in bad[:4]
    )
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    raise StoreConfigError(
        f"{where}: the data files of {ranks_text(bad)} are not there as written ({shown}{more}): "
        "the ranks did not write into the one store that rank 0 commits to (another endpoint, "
        "or a directory not shared with rank 0); nothing was committed"
    )
