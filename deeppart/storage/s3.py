"""S3 (and S3-compatible servers) through ``obstore``, the Python binding
of the Rust ``object_store`` crate (Apache Arrow).

:func:`s3_store` makes an :class:`S3Store` for an ``s3://bucket/prefix``
URL. Endpoint, region and credentials are the S3 ecosystem's environment
variables, read by ``obstore`` itself when the store is made:
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` (or ``AWS_TOKEN``),
``AWS_SKIP_SIGNATURE``, and on AWS the instance, container and
web-identity credentials (``AWS_CONTAINER_CREDENTIALS_*``,
``AWS_WEB_IDENTITY_TOKEN_FILE``, ``AWS_ROLE_ARN``). What the environment
does not give comes from the AWS shared files, ``~/.aws/credentials`` and
``~/.aws/config``, and their profile (``AWS_PROFILE``):
:mod:`deeppart.storage.aws_profile` (keys, session token, web-identity
role, ``credential_process``, region, ``endpoint_url``,
``s3 = addressing_style``).

Addressing: path-style (``http://endpoint/bucket/key``) by default;
virtual-hosted style (``http://bucket.endpoint/key``, which some providers
require) with ``AWS_VIRTUAL_HOSTED_STYLE_REQUEST=true`` (or the profile's
``addressing_style = virtual``). An ``http://``
endpoint (a test server) is allowed without further settings.

DeepPart's own knobs (environment): ``DEEPPART_S3_PART_BYTES`` (the
multipart part size and upload buffer, default 16 MiB; S3's minimum is
5 MiB), ``DEEPPART_S3_CONCURRENCY`` (parts in flight per writer and ranges
per read, default 8: a writer holds at most about (concurrency + 1) x part
bytes), ``DEEPPART_S3_RETRY_TIMEOUT_S`` and ``DEEPPART_S3_MAX_RETRIES``
(``object_store``'s retries of failed requests; defaults 180 s and 10),
``DEEPPART_S3_TIMEOUT_S`` (one request's limit; ``object_store``'s default
30 s), ``DEEPPART_S3_STORE_ID`` (a name for the store that replaces the
endpoint in the comparison of the ranks' stores, :meth:`S3Store.identity`:
set it to one value on every rank where each node reaches the same store
through its own endpoint). Loads read ahead (:mod:`deeppart.storage.readahead`):
``DEEPPART_S3_READ_CHUNK_BYTES`` (one ranged GET of the read-ahead,
default 8 MiB) and ``DEEPPART_S3_READ_AHEAD`` (the most chunks a reader
holds, fetched or in flight, default 16: at most 128 MiB per reader; 0
turns the read-ahead off), ``DEEPPART_S3_CONCURRENCY`` of them fetched at
a time.

A bucket that does not exist, an endpoint that cannot be reached and a
refused access raise :class:`~deeppart.errors.StoreConfigError` with one
line naming the URL, the bucket and the endpoint
(:meth:`S3Store.config_error`; the client's error is its ``__cause__``).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from deeppart.errors import StoreConfigError
from deeppart.storage.aws_profile import ENDPOINT_VARS, profile_settings
from deeppart.storage.base import ObjectExistsError, ObjectInfo, ObjectStore, ObjectWriter
from deeppart.storage.identity import Identity, normalise_endpoint
from deeppart.storage.url import S3URL, parse_s3_url

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PART_BYTES",
    "DEFAULT_READ_AHEAD",
    "DEFAULT_READ_CHUNK_BYTES",
    "S3Store",
    "endpoint_from_env",
    "s3_store",
]

DEFAULT_PART_BYTES = 16 << 20
DEFAULT_CONCURRENCY = 8
DEFAULT_READ_CHUNK_BYTES = 8 << 20
DEFAULT_READ_AHEAD = 16
#: S3's smallest multipart part (all but the last).
MIN_PART_BYTES = 5 << 20
#: The region obstore signs for when none is set.
DEFAULT_REGION = "us-east-1"
#: The variable naming the store in place of its endpoint (see the module's docstring).
STORE_ID_VAR = "DEEPPART_S3_STORE_ID"

#: S3 error codes of a refused access (credentials or policy).
_DENIED = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
    }
)
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
#: The request in a client's error (``GET http://host/bucket/key``).
_REQUEST = re.compile(r"performing ([A-Z]+ \S+)")
#: The HTTP status a server answered, in a client's error.
_STATUS = re.compile(r"status code: (\d{3})")


def endpoint_from_env() -> str | None:
    """The endpoint that obstore takes from the environment, if any."""
    for var in ENDPOINT_VARS:
        value = os.environ.get(var)
        if value:
            return value
    return None


def _env_int(name: str, default: int, least: int = 1) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError as e:
        raise ValueError(f"{name}={text!r}: not an integer") from e
    if value < least:
        raise ValueError(f"{name}={value}: must be at least {least}")
    return value


class _Writer:
    """An :class:`ObjectWriter` over obstore's buffered writer: a single
    PUT for an object smaller than one part, a multipart upload of
    ``part_bytes`` parts, ``concurrency`` in flight, above."""

    def __init__(self, store: S3Store, name: str) -> None:
        import obstore

        self.store = store
        self.name = name
        self.file = obstore.open_writer(
            store.obstore, name, buffer_size=store.part_bytes, max_concurrency=store.concurrency
        )

    def write(self, data: Any, /) -> int:
        with self.store.errors():
            return int(self.file.write(data))

    def close(self) -> None:
        with self.store.errors():
            self.file.close()

    def abort(self) -> None:
        # obstore has no abort of a multipart upload: the upload is
        # completed and the object removed, so no parts stay behind.
        try:
            if not self.file.closed():
                self.file.close()
        finally:
            self.store.delete(self.name)


class S3Store(ObjectStore):
    """The objects under ``s3://bucket/prefix`` (see the module's docstring)."""

    def __init__(
        self,
        url: S3URL,
        *,
        part_bytes: int | None = None,
        concurrency: int | None = None,
        read_chunk_bytes: int | None = None,
        read_ahead: int | None = None,
        client: Any = None,
    ) -> None:
        try:
            from obstore.store import S3Store as Client
        except ImportError as e:
            raise StoreConfigError(
                f"{url}: S3 needs obstore (pip install 'deeppart[s3]'): {e}"
            ) from e

        self.location = url
        self.url = str(url)
        self.part_bytes = part_bytes or _env_int("DEEPPART_S3_PART_BYTES", DEFAULT_PART_BYTES)
        if self.part_bytes < MIN_PART_BYTES:
            raise ValueError(f"S3 part size {self.part_bytes}: S3's minimum is {MIN_PART_BYTES}")
        self.concurrency = concurrency or _env_int("DEEPPART_S3_CONCURRENCY", DEFAULT_CONCURRENCY)
        self.read_chunk_bytes = read_chunk_bytes or _env_int(
            "DEEPPART_S3_READ_CHUNK_BYTES", DEFAULT_READ_CHUNK_BYTES
        )
        self.read_ahead = (
            read_ahead
            if read_ahead is not None
            else _env_int("DEEPPART_S3_READ_AHEAD", DEFAULT_READ_AHEAD, least=0)
        )
        self.read_threads = self.concurrency
        if client is None:
            profile = profile_settings()
            endpoint = endpoint_from_env() or profile.endpoint
            retry: dict[str, Any] = {
                "max_retries": _env_int("DEEPPART_S3_MAX_RETRIES", 10, least=0),
                "retry_timeout": timedelta(
                    seconds=_env_int("DEEPPART_S3_RETRY_TIMEOUT_S", 180, least=0)
                ),
            }
            options: dict[str, Any] = {
                "allow_http": bool(endpoint and endpoint.startswith("http://")),
            }
            if os.environ.get("DEEPPART_S3_TIMEOUT_S"):
                options["timeout"] = timedelta(seconds=_env_int("DEEPPART_S3_TIMEOUT_S", 30))
            client = Client(
                url.bucket,
                prefix=url.prefix or None,
                config=profile.config or None,  # type: ignore[arg-type]
                credential_provider=profile.credentials,  # type: ignore[arg-type]
                client_options=options,  # type: ignore[arg-type]
                retry_config=retry,  # type: ignore[arg-type]
            )
        self.obstore = client
        #: The endpoint (None: AWS's, by region), region and addressing the
        #: client uses, from its config and the environment.
        self.endpoint, self.region, self.virtual = client_settings(client.config)

    @property
    def endpoint_shown(self) -> str:
        """The endpoint as messages name it."""
        return self.endpoint or f"AWS S3 in {self.region}"

    def identity(self) -> Identity:
        """The store as this process resolved it, which every rank of a
        save must share (:mod:`deeppart.storage.identity`): the endpoint
        (normalised; ``DEEPPART_S3_STORE_ID`` in its place where set), the
        region, bucket, key prefix and addressing style."""
        named = os.environ.get(STORE_ID_VAR)
        endpoint = normalise_endpoint(self.endpoint) if self.endpoint else "(AWS)"
        return {
            "endpoint": f"{STORE_ID_VAR}={named}" if named else endpoint,
            "region": self.region,
            "bucket": self.location.bucket,
            "prefix": self.location.prefix,
            "addressing": "virtual-hosted" if self.virtual else "path",
        }

    def config_error(self, e: BaseException) -> StoreConfigError | None:
        """``e`` (an error of the client) as a one-line StoreConfigError
        when it says that the bucket does not exist, that the endpoint
        cannot be reached, or that access was refused; else None."""
        found = self._failure(e)
        return StoreConfigError(found[1]) if found is not None else None

    def _failure(self, e: BaseException) -> tuple[str, str] | None:
        """What :meth:`config_error` reports: ``("bucket" | "denied" |
        "unreachable", message)``, or None."""
        text = str(e)
        found = _CODE.search(text)
        code = found.group(1) if found else ""
        answered = _STATUS.search(text)
        status = answered.group(1) if answered else ""
        bucket = self.location.bucket
        if code == "NoSuchBucket":
            return "bucket", (
                f"{self.url}: the bucket {bucket!r} does not exist at {self.endpoint_shown}: "
                "create it, or check the URL and the endpoint (AWS_ENDPOINT_URL, or the "
                "profile's endpoint_url)"
            )
        if code in _DENIED or status in ("401", "403"):
            why = code or f"HTTP {status}"
            return "denied", (
                f"{self.url}: {self.endpoint_shown} refused access to the bucket {bucket!r} "
                f"({why}): check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the "
                "bucket's policy"
            )
        lower = text.lower()
        # Only a failure to connect (a server that stops answering later is
        # not a wrong endpoint).
        if "tcp connect error" in lower or "dns error" in lower:
            why = (
                "connection refused" if "connection refused" in lower
                else "its name does not resolve" if "dns error" in lower
                else "connection timed out" if "timed out" in lower
                else "no connection"
            )  # fmt: skip
            request = _REQUEST.search(text)
            if request is not None:
                why = f"{request.group(1)}: {why}"
            return "unreachable", (
                f"{self.url}: cannot reach the endpoint {self.endpoint_shown} ({why}): check "
                "AWS_ENDPOINT_URL (or the profile's endpoint_url) and the network"
            )
        return None

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """Raises the client's errors inside as :meth:`config_error` says
        (from the client's), others as they are."""
        try:
            yield
        except StoreConfigError:
            raise
        except Exception as e:
            err = self.config_error(e)
            if err is None:
                raise
            raise err from e

    def probe(self) -> None:
        """One listing request (of at most one key): StoreConfigError if
        the bucket does not exist or the endpoint cannot be reached (what a
        HEAD's bare 404 does not tell). A refused listing says nothing
        here (a reader may lack the right to list)."""
        import obstore

        try:
            next(iter(obstore.list(self.obstore, None, chunk_size=1)), None)
        except Exception as e:
            found = self._failure(e)
            if found is not None and found[0] != "denied":
                raise StoreConfigError(found[1]) from e

    def child(self, prefix: str) -> S3Store:
        prefix = prefix.strip("/")
        inner = f"{self.location.prefix}/{prefix}".strip("/")
        from obstore.store import S3Store as Client

        client = Client(
            self.location.bucket,
            prefix=inner or None,
            config={k: v for k, v in self.obstore.config.items() if k != "bucket"},  # type: ignore[arg-type]
            credential_provider=self.obstore.credential_provider,
            client_options=self.obstore.client_options,
            retry_config=self.obstore.retry_config,
        )
        return S3Store(
            S3URL(self.location.bucket, inner),
            part_bytes=self.part_bytes,
            concurrency=self.concurrency,
            read_chunk_bytes=self.read_chunk_bytes,
            read_ahead=self.read_ahead,
            client=client,
        )

    def get(self, name: str) -> bytes:
        import obstore

        with self.errors():
            return bytes(obstore.get(self.obstore, name).bytes())

    def read_into(self, name: str, offset: int, buf: memoryview) -> int:
        with self.errors():
            return self._read_into(name, offset, buf)

    def _read_into(self, name: str, offset: int, buf: memoryview) -> int:
        if len(buf) == 0:
            return 0
        try:
            return self._read_ranges(name, offset, buf)
        except FileNotFoundError:
            raise
        except Exception:
            # A range past the object's end: only then is its size asked
            # (a load's reads lie within sizes it has checked).
            size = self.head(name).size
            if offset + len(buf) <= size:
                raise
            if offset >= size:
                return 0
            return self._read_ranges(name, offset, buf[: size - offset])

    def read_range(self, name: str, offset: int, length: int) -> Any:
        """One ranged GET (the read-ahead's chunks): obstore's buffer, no
        copy."""
        import obstore

        if length == 0:
            return b""
        with self.errors():
            try:
                return obstore.get_range(self.obstore, name, start=offset, length=length)
            except FileNotFoundError:
                raise
            except Exception:
                # A range that starts at or past the object's end (one that
                # ends past it gets the rest).
                if offset < self.head(name).size:
                    raise
                return b""

    def _read_ranges(self, name: str, offset: int, buf: memoryview) -> int:
        """``buf`` filled from ``offset`` by ranged GETs of at most a part
        each, ``concurrency`` at a time; returns the bytes received."""
        import obstore

        want = len(buf)
        step = self.part_bytes
        starts = list(range(offset, offset + want, step))
        ends = [min(s + step, offset + want) for s in starts]
        got = 0
        for i in range(0, len(starts), self.concurrency):
            batch = slice(i, i + self.concurrency)
            parts = obstore.get_ranges(
                self.obstore, name, starts=starts[batch], ends=ends[batch], coalesce=0
            )
            for s, part in zip(starts[batch], parts, strict=True):
                data = memoryview(part)
                buf[s - offset : s - offset + len(data)] = data
                got += len(data)
        return got

    def head(self, name: str) -> ObjectInfo:
        import obstore

        with self.errors():
            m = obstore.head(self.obstore, name)
        return ObjectInfo(name, int(m["size"]), m["last_modified"].timestamp(), m["e_tag"])

    def put(
        self, name: str, data: bytes, *, create: bool = False, if_match: str | None = None
    ) -> str | None:
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        mode: Any = "overwrite"
        if create:
            mode = "create"
        elif if_match is not None:
            mode = {"e_tag": if_match}
        try:
            with self.errors():
                result = obstore.put(self.obstore, name, data, mode=mode, use_multipart=False)
        except (AlreadyExistsError, PreconditionError) as e:
            raise ObjectExistsError(f"{self.describe(name)}: {type(e).__name__}") from e
        return result["e_tag"]

    def writer(self, name: str) -> ObjectWriter:
        return _Writer(self, name)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        import obstore

        with self.errors():
            for batch in obstore.list(self.obstore, prefix.strip("/") or None):
                for m in batch:
                    yield ObjectInfo(
                        str(m["path"]), int(m["size"]), m["last_modified"].timestamp(), m["e_tag"]
                    )

    def delete(self, name: str) -> None:
        import obstore

        with self.errors(), contextlib.suppress(FileNotFoundError):
            obstore.delete(self.obstore, name)

    def abort_uploads(self, prefix: str, accept: Callable[[str], bool]) -> tuple[str, ...]:
        """Through boto3 (obstore cannot list or abort multipart uploads);
        nothing without boto3 (``pip install boto3``): a bucket lifecycle
        rule removes them then). A failure to list or abort them is a
        warning: they are a cleanup's, not a checkpoint's."""
        try:
            return tuple(_abort_uploads(self, prefix, accept))
        except Exception as e:
            warnings.warn(
                f"{self.describe(prefix)}: incomplete uploads were not aborted "
                f"({type(e).__name__}: {e}); a bucket lifecycle rule "
                "(AbortIncompleteMultipartUpload) removes them",
                stacklevel=2,
            )
            return ()


def object_store_flag(text: str) -> bool:
    """A boolean setting read as ``object_store`` (obstore's client) reads
    it, so that DeepPart's own calls agree with the client's: ``1``,
    ``true``, ``on``, ``yes``, ``y`` in any case are true."""
    return text.lower() in ("1", "true", "on", "yes", "y")


def client_settings(config: dict[str, Any]) -> tuple[str | None, str, bool]:
    """The endpoint (None: AWS's), region and whether virtual-hosted
    addressing is on, of an obstore S3 client made with ``config`` in this
    environment: its config first, then the variables it reads."""
    endpoint = config.get("endpoint") or endpoint_from_env()
    region = (
        config.get("region")
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
        or DEFAULT_REGION
    )
    virtual = object_store_flag(
        str(
            config.get("virtual_hosted_style_request")
            or os.environ.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "")
        )
    )
    return endpoint, str(region), virtual


def _boto3_client(store: S3Store) -> Any:
    """A boto3 client reaching ``store``'s bucket as its obstore client does
    (endpoint, region, credentials, addressing), or None without boto3:
    the calls obstore lacks (listing and aborting multipart uploads)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        return None
    config = store.obstore.config
    keys: dict[str, Any] = {}
    if config.get("access_key_id"):
        keys = {
            "aws_access_key_id": config["access_key_id"],
            "aws_secret_access_key": config.get("secret_access_key"),
            "aws_session_token": config.get("session_token"),
        }
    elif store.obstore.credential_provider is not None:
        got = store.obstore.credential_provider()
        keys = {
            "aws_access_key_id": got["access_key_id"],
            "aws_secret_access_key": got["secret_access_key"],
            "aws_session_token": got.get("token"),
        }
    return boto3.client(
        "s3",
        endpoint_url=store.endpoint,
        region_name=store.region,
        config=Config(
            s3={"addressing_style": "virtual" if store.virtual else "path"},
            retries={"max_attempts": 3, "mode": "standard"},
        ),
        **keys,
    )


def _abort_uploads(store: S3Store, prefix: str, accept: Callable[[str], bool]) -> list[str]:
    client = _boto3_client(store)
    if client is None:
        return []
    under = "/".join(p for p in (store.location.prefix, prefix.strip("/")) if p) + "/"
    aborted = []
    for page in client.get_paginator("list_multipart_uploads").paginate(
        Bucket=store.location.bucket, Prefix=under
    ):
        for upload in page.get("Uploads", []):
            name = upload["Key"][len(under) :]
            if upload["Key"].startswith(under) and accept(name):
                client.abort_multipart_upload(
                    Bucket=store.location.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
                aborted.append(name)
    return aborted


def s3_store(url: str | S3URL) -> S3Store:
    """The :class:`S3Store` of ``s3://bucket/prefix`` (configured from the
    environment, see the module's docstring)."""
    return S3Store(parse_s3_url(url) if isinstance(url, str) else url)
