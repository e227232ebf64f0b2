"""A real S3-protocol server for the tests: moto's server mode
(``moto_server``, from ``moto[server]`` in requirements/dev.txt), started
on 127.0.0.1 on a free port, in memory.

:class:`S3Server` starts and stops it and makes buckets;
:meth:`S3Server.env` is the environment a client needs (the standard
``AWS_*`` variables, which obstore reads). The conftest fixtures
``s3_server`` (one per test session) and ``s3_url`` (a fresh bucket per
test, the variables set) use it; tests skip with the reason when moto is
not installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: Credentials moto accepts (it checks none); the region it serves.
ACCESS_KEY = "deeppart-test"
SECRET_KEY = "deeppart-test-secret"
REGION = "us-east-1"

#: Python source that a child process runs before its save: the process
#: dies (exit status 17) once more than 11 MiB of a data file went to the
#: store, so that with 5 MiB parts (``DEEPPART_S3_PART_BYTES``) the file's
#: multipart upload stays incomplete, invisible to listing.
DIE_MID_UPLOAD = """
import os, time
from deeppart.storage import s3

written = [0]
write = s3._Writer.write

def dying_write(self, data):
    written[0] += len(memoryview(data).cast("B"))
    n = write(self, data)
    if written[0] > (11 << 20):
        time.sleep(1)  # the parts in flight reach the server
        os._exit(17)  # killed mid-upload: the multipart upload stays incomplete
    return n

s3._Writer.write = dying_write
"""


def uploads(url: str, prefix: str) -> set[str]:
    """The keys of the incomplete multipart uploads under ``url/prefix``."""
    import boto3

    bucket = url[len("s3://") :]
    client = boto3.client("s3")
    found = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return {u["Key"] for u in found}


def moto_command() -> list[str] | None:
    """The command that runs moto's server, or None if moto is absent."""
    exe = Path(sys.executable).parent / "moto_server"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("moto_server")
    return [found] if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """One moto server process on 127.0.0.1. ``checks_credentials``: moto
    checks every request's keys against its IAM (``INITIAL_NO_AUTH_ACTION_COUNT=0``),
    which knows none of the tests' keys: every request is refused
    (InvalidAccessKeyId, 403), as a server refuses wrong credentials."""

    def __init__(self, log: Path, checks_credentials: bool = False) -> None:
        cmd = moto_command()
        if cmd is None:
            raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
        self.cmd = cmd
        self.log = log
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        #: What the server's environment adds to this process's.
        self.extra_env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if checks_credentials else {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None, timeout_s: float = 30) -> None:
        """Starts the server (on ``port``, default a free one) and waits
        until it answers."""
        self.port = port or free_port()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.cmd, "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **self.extra_env},
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited ({self.proc.returncode}); see {self.log}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer in {timeout_s} s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """Kills the server (SIGKILL: in-flight requests fail)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def env(self) -> dict[str, str]:
        """The environment a client of this server needs."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            # Not the developer's own AWS files and profile.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            # No retries stretching a test's failure out over minutes.
            "DEEPPART_S3_RETRY_TIMEOUT_S": "5",
            "DEEPPART_S3_MAX_RETRIES": "2",
        }

    def make_bucket(self, name: str) -> str:
        """Creates bucket ``name``; returns ``s3://name``."""
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        urllib.request.urlopen(req, timeout=10).close()
        return f"s3://{name}"

    def _client(self, bucket: str) -> Any:
        from obstore.store import S3Store

        return S3Store(
            bucket,
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region=REGION,
            client_options={"allow_http": True},
        )

    def put_raw(self, bucket: str, key: str, data: bytes) -> None:
        """Puts an object with a plain client (obstore, not DeepPart's
        storage layer): the tests' foreign objects and damaged files."""
        import obstore

        obstore.put(self._client(bucket), key, data)

    def get_raw(self, bucket: str, key: str) -> bytes | None:
        """An object's bytes through a plain client; None if missing."""
        import obstore

        try:
            return bytes(obstore.get(self._client(bucket), key).bytes())
        except FileNotFoundError:
            return None
