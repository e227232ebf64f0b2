"""The AWS shared config and credentials files, for the S3 settings that
the environment does not give (``obstore`` reads only the environment).

The files and the profile are found as the AWS CLI and SDKs find them:
``AWS_SHARED_CREDENTIALS_FILE`` (default ``~/.aws/credentials``) and
``AWS_CONFIG_FILE`` (default ``~/.aws/config``); the profile is
``AWS_PROFILE`` (or ``AWS_DEFAULT_PROFILE``), else ``default``. In the
credentials file a profile's section is ``[name]``; in the config file
``[default]`` or ``[profile name]``.

What a profile gives, each only where the environment has none of it (the
environment comes first, as in the SDKs):

- credentials: ``aws_access_key_id`` and ``aws_secret_access_key`` (and
  ``aws_session_token``), from the credentials file, else the config file;
  or ``role_arn`` with ``web_identity_token_file`` (and
  ``role_session_name``), the web-identity role that ``obstore`` assumes;
  or ``credential_process``: the command is run (without a shell, as the
  CLI runs it) when the client first needs credentials and again before
  they expire, and its JSON (``Version`` 1, ``AccessKeyId``,
  ``SecretAccessKey``, ``SessionToken``, ``Expiration``) is checked:
  :class:`ProcessCredentials`;
- ``region``;
- the endpoint: the ``endpoint_url`` of the profile's ``s3`` sub-section,
  of the ``[services NAME]`` section that its ``services`` names, or the
  profile's own ``endpoint_url`` (none with
  ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true``);
- addressing: ``addressing_style = virtual`` in the profile's ``s3``
  sub-section (``path`` and ``auto`` keep path-style).

A profile whose credentials come from something DeepPart does not run
(SSO, a role assumed from another profile) raises
:class:`~deeppart.errors.StoreConfigError` naming the profile and the key,
as does a named profile that neither file has, a key id without its
secret, or a file that is not INI: a clear error instead of requests
signed with nothing.
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from deeppart.errors import StoreConfigError

__all__ = ["ENDPOINT_VARS", "ProcessCredentials", "ProfileSettings", "profile_settings"]

#: A credential_process's answer with an ``Expiration`` is renewed this
#: long before it (one without is kept, as the CLI keeps it).
REFRESH_BEFORE = timedelta(minutes=5)
#: The longest a credential_process may run.
PROCESS_TIMEOUT_S = 60

#: A profile's credential sources that DeepPart does not run.
_UNSUPPORTED_SOURCES = (
    "sso_session",
    "sso_start_url",
    "source_profile",
    "credential_source",
)

#: The environment variables that already give each setting (as obstore
#: reads them).
_ENV_CREDENTIALS = ("AWS_ACCESS_KEY_ID",)
_ENV_ROLE = ("AWS_WEB_IDENTITY_TOKEN_FILE",)
_ENV_REGION = ("AWS_REGION", "AWS_DEFAULT_REGION")
#: The endpoint variables, in the order obstore prefers them.
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_ENV_ADDRESSING = ("AWS_VIRTUAL_HOSTED_STYLE_REQUEST",)


@dataclass(frozen=True)
class ProfileSettings:
    """What the files add to the environment: ``config``, obstore's S3
    config keys (``access_key_id``, ``region``, ``endpoint``, ...); the
    profile's name and the files read, for messages."""

    profile: str
    config: dict[str, str] = field(default_factory=dict)
    files: tuple[Path, ...] = ()
    #: The client's credential provider (a profile's credential_process).
    credentials: ProcessCredentials | None = None

    @property
    def endpoint(self) -> str | None:
        return self.config.get("endpoint")


def _truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def _read(path: Path) -> configparser.ConfigParser:
    # Not strict: a repeated section or key is the last one, as the CLI reads it.
    parser = configparser.ConfigParser(interpolation=None, default_section="\x00none", strict=False)
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f, source=str(path))
    except (configparser.Error, UnicodeDecodeError) as e:
        raise StoreConfigError(f"{path}: not an AWS config file: {e}") from e
    return parser


def _nested(text: str, where: str) -> dict[str, str]:
    """A sub-section's ``key = value`` lines (``s3 =`` then indented lines)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, eq, value = line.partition("=")
        if not eq:
            raise StoreConfigError(f"{where}: {line!r} is not 'key = value'")
        out[key.strip().lower()] = value.strip()
    return out


def _file(environ: Mapping[str, str], var: str, default: str) -> Path:
    text = environ.get(var)
    if text:
        return Path(text).expanduser()
    home = environ.get("HOME")
    return (Path(home) if home else Path.home()) / ".aws" / default


def profile_settings(environ: Mapping[str, str] | None = None) -> ProfileSettings:
    """The S3 settings that the shared files give and ``environ`` (default
    ``os.environ``) does not (see the module's docstring)."""
    env = os.environ if environ is None else environ
    named = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    profile = named or "default"
    creds_path = _file(env, "AWS_SHARED_CREDENTIALS_FILE", "credentials")
    config_path = _file(env, "AWS_CONFIG_FILE", "config")

    creds: dict[str, str] | None = None
    conf: dict[str, str] | None = None
    conf_file: configparser.ConfigParser | None = None
    read: list[Path] = []
    if creds_path.is_file():
        read.append(creds_path)
        parser = _read(creds_path)
        if parser.has_section(profile):
            creds = {k.lower(): v.strip() for k, v in parser.items(profile)}
    if config_path.is_file():
        read.append(config_path)
        conf_file = _read(config_path)
        for section in ([profile, f"profile {profile}"] if profile == "default"
                        else [f"profile {profile}"]):  # fmt: skip
            if conf_file.has_section(section):
                conf = {k.lower(): v.strip() for k, v in conf_file.items(section)}
                break
    if creds is None and conf is None:
        if named:
            where = " or ".join(str(p) for p in (creds_path, config_path))
            raise StoreConfigError(f"AWS profile {profile!r} (AWS_PROFILE) is not in {where}")
        return ProfileSettings(profile, {}, tuple(read))
    conf = conf or {}
    where = f"AWS profile {profile!r}"

    def has_env(names: tuple[str, ...]) -> bool:
        return any(env.get(n) for n in names)

    out: dict[str, str] = {}
    provider: ProcessCredentials | None = None
    if not has_env(_ENV_CREDENTIALS) and not has_env(_ENV_ROLE):
        for source in (creds or {}, conf):
            key_id = source.get("aws_access_key_id")
            secret = source.get("aws_secret_access_key")
            if key_id or secret:
                if not (key_id and secret):
                    raise StoreConfigError(
                        f"{where}: aws_access_key_id and aws_secret_access_key come together; "
                        "the profile has only one of them"
                    )
                out["access_key_id"] = key_id
                out["secret_access_key"] = secret
                token = source.get("aws_session_token") or source.get("aws_security_token")
                if token:
                    out["session_token"] = token
                break
        else:
            process = (creds or {}).get("credential_process") or conf.get("credential_process")
            if process:
                provider = ProcessCredentials(process, profile)
            elif conf.get("role_arn") and conf.get("web_identity_token_file"):
                out["role_arn"] = conf["role_arn"]
                out["web_identity_token_file"] = conf["web_identity_token_file"]
                if conf.get("role_session_name"):
                    out["role_session_name"] = conf["role_session_name"]
            else:
                for key in _UNSUPPORTED_SOURCES:
                    if conf.get(key) or (creds or {}).get(key):
                        raise StoreConfigError(
                            f"{where} gets its credentials through {key}, which DeepPart "
                            "does not run: export them (for example "
                            f'eval "$(aws configure export-credentials --profile {profile} '
                            '--format env)") or give the profile aws_access_key_id and '
                            "aws_secret_access_key"
                        )
    if not has_env(_ENV_REGION) and conf.get("region"):
        out["region"] = conf["region"]
    s3 = _nested(conf.get("s3", ""), f"{where}: s3")
    if not has_env(ENDPOINT_VARS) and not _truthy(env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")):
        endpoint = s3.get("endpoint_url")
        services = conf.get("services")
        if not endpoint and services and conf_file is not None:
            section = f"services {services}"
            if not conf_file.has_section(section):
                raise StoreConfigError(f"{where}: services = {services}: no [{section}] section")
            nested = dict(conf_file.items(section)).get("s3", "")
            endpoint = _nested(nested, f"[{section}] s3").get("endpoint_url")
        endpoint = endpoint or conf.get("endpoint_url")
        if endpoint:
            out["endpoint"] = endpoint
    style = s3.get("addressing_style", "").lower()
    if style not in ("", "path", "auto", "virtual"):
        raise StoreConfigError(
            f"{where}: s3 addressing_style = {style}: expected virtual, path or auto"
        )
    if style == "virtual" and not has_env(_ENV_ADDRESSING):
        out["virtual_hosted_style_request"] = "true"
    return ProfileSettings(profile, out, tuple(read), provider)


class ProcessCredentials:
    """A profile's ``credential_process`` as obstore's credential provider:
    runs the command when called and keeps its answer until
    :data:`REFRESH_BEFORE` its ``Expiration`` (for ever without one, as the
    CLI does). A command that fails, times out or answers anything but
    version 1 JSON with both keys raises :class:`StoreConfigError` naming
    the profile."""

    def __init__(self, command: str, profile: str) -> None:
        self.command = command
        self.profile = profile
        self._lock = threading.Lock()
        self._kept: dict[str, Any] | None = None

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            kept = self._kept
            if kept is None or (
                kept["expires_at"] is not None
                and kept["expires_at"] - REFRESH_BEFORE <= datetime.now(UTC)
            ):
                kept = self._kept = self._run()
            return dict(kept)

    def _run(self) -> dict[str, Any]:
        where = f"AWS profile {self.profile!r}: credential_process"
        try:
            done = subprocess.run(
                shlex.split(self.command),
                capture_output=True,
                timeout=PROCESS_TIMEOUT_S,
                check=False,
            )
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            raise StoreConfigError(f"{where} {self.command!r} did not run: {e}") from e
        if done.returncode != 0:
            err = done.stderr.decode("utf-8", "replace").strip()[-500:]
            raise StoreConfigError(f"{where} exited with {done.returncode}: {err}")
        try:
            answer = json.loads(done.stdout)
        except ValueError as e:
            raise StoreConfigError(f"{where}: its output is not JSON: {e}") from e
        if not isinstance(answer, dict) or answer.get("Version") != 1:
            raise StoreConfigError(f'{where}: expected JSON with "Version": 1')
        key_id, secret = answer.get("AccessKeyId"), answer.get("SecretAccessKey")
        if not (isinstance(key_id, str) and key_id and isinstance(secret, str) and secret):
            raise StoreConfigError(f"{where}: AccessKeyId and SecretAccessKey are required")
        token = answer.get("SessionToken")
        expires: datetime | None = None
        if answer.get("Expiration") is not None:
            try:
                expires = datetime.fromisoformat(str(answer["Expiration"]).replace("Z", "+00:00"))
            except ValueError as e:
                raise StoreConfigError(f"{where}: Expiration: {e}") from e
            if expires.tzinfo is None:
                expires = expires.replace(tzinfo=UTC)
        return {
            "access_key_id": key_id,
            "secret_access_key": secret,
            "token": token if isinstance(token, str) and token else None,
            "expires_at": expires,
        }
