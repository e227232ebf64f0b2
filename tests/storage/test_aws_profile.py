"""S3 settings from the AWS shared config and credentials files
(deeppart/storage/aws_profile.py): the profile's keys, region, endpoint
and addressing where the environment has none; the environment first;
clear errors for a missing profile, half a key pair, credential sources
DeepPart does not run and malformed files. The same files drive a real
save and load against the S3 server in tests/storage/test_storage.py."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deeppart.errors import StoreConfigError
from deeppart.storage.aws_profile import ProcessCredentials, profile_settings

CREDENTIALS = """\
[default]
aws_access_key_id = DEFAULTKEY
aws_secret_access_key = defaultsecret

[train]
aws_access_key_id = TRAINKEY
aws_secret_access_key = trainsecret
aws_session_token = traintoken
"""

CONFIG = """\
[default]
region = eu-west-1

[profile train]
region = eu-central-1
endpoint_url = http://profile.example:9000
s3 =
    addressing_style = virtual

[profile svc]
aws_access_key_id = SVCKEY
aws_secret_access_key = svcsecret
services = mine
endpoint_url = http://ignored.example

[services mine]
s3 =
  endpoint_url = http://service.example:9000

[profile sso]
sso_session = corp
region = us-west-2

[profile proc]
credential_process = /bin/echo {}

[profile assume]
role_arn = arn:aws:iam::123456789012:role/train
source_profile = default

[profile web]
role_arn = arn:aws:iam::123456789012:role/web
web_identity_token_file = /var/run/token
role_session_name = deeppart

[profile half]
aws_access_key_id = ONLYKEY
"""


def files(tmp_path: Path, credentials: str = CREDENTIALS, config: str = CONFIG) -> dict[str, str]:
    (tmp_path / "credentials").write_text(credentials)
    (tmp_path / "config").write_text(config)
    return {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
        "AWS_CONFIG_FILE": str(tmp_path / "config"),
    }


def test_default_profile_keys_and_region(tmp_path: Path) -> None:
    got = profile_settings(files(tmp_path))
    assert got.profile == "default"
    assert got.config == {
        "access_key_id": "DEFAULTKEY",
        "secret_access_key": "defaultsecret",
        "region": "eu-west-1",
    }
    assert got.endpoint is None


def test_named_profile_token_endpoint_and_virtual_addressing(tmp_path: Path) -> None:
    got = profile_settings({**files(tmp_path), "AWS_PROFILE": "train"})
    assert got.config == {
        "access_key_id": "TRAINKEY",
        "secret_access_key": "trainsecret",
        "session_token": "traintoken",
        "region": "eu-central-1",
        "endpoint": "http://profile.example:9000",
        "virtual_hosted_style_request": "true",
    }
    # AWS_DEFAULT_PROFILE names it too.
    env = {**files(tmp_path), "AWS_DEFAULT_PROFILE": "train"}
    assert profile_settings(env).config == got.config


def test_the_environment_comes_first(tmp_path: Path) -> None:
    env = {
        **files(tmp_path),
        "AWS_PROFILE": "train",
        "AWS_ACCESS_KEY_ID": "ENVKEY",
        "AWS_SECRET_ACCESS_KEY": "envsecret",
        "AWS_REGION": "ap-south-1",
        "AWS_ENDPOINT_URL": "http://env.example",
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
    }
    assert profile_settings(env).config == {}
    # AWS_IGNORE_CONFIGURED_ENDPOINT_URLS drops the profile's endpoint only.
    env = {**files(tmp_path), "AWS_PROFILE": "train", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}
    got = profile_settings(env).config
    assert "endpoint" not in got and got["access_key_id"] == "TRAINKEY"


def test_the_credentials_file_comes_before_the_config_file(tmp_path: Path) -> None:
    config = "[default]\naws_access_key_id = CONFKEY\naws_secret_access_key = confsecret\n"
    got = profile_settings(files(tmp_path, config=config))
    assert got.config["access_key_id"] == "DEFAULTKEY"
    got = profile_settings(files(tmp_path, credentials="", config=config))
    assert got.config["access_key_id"] == "CONFKEY"


def test_services_section_endpoint_and_web_identity_role(tmp_path: Path) -> None:
    env = files(tmp_path)
    got = profile_settings({**env, "AWS_PROFILE": "svc"})
    assert got.endpoint == "http://service.example:9000"
    assert got.config["access_key_id"] == "SVCKEY"
    assert profile_settings({**env, "AWS_PROFILE": "web"}).config == {
        "role_arn": "arn:aws:iam::123456789012:role/web",
        "web_identity_token_file": "/var/run/token",
        "role_session_name": "deeppart",
    }


def test_no_files_and_no_profile_give_nothing(tmp_path: Path) -> None:
    env = {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "nothing"),
    }
    got = profile_settings(env)
    assert got.config == {} and got.files == ()
    # HOME's ~/.aws is where they are looked for by default.
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(CREDENTIALS)
    got = profile_settings({"HOME": str(tmp_path)})
    assert got.config["access_key_id"] == "DEFAULTKEY"
    assert got.files == (tmp_path / ".aws" / "credentials",)


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ("nobody", r"AWS profile 'nobody' \(AWS_PROFILE\) is not in .*credentials or .*config"),
        ("half", r"'half': aws_access_key_id and aws_secret_access_key come together"),
        ("sso", r"'sso' gets its credentials through sso_session.*export-credentials"),
        ("assume", r"'assume' gets its credentials through source_profile"),
    ],
)
def test_profiles_deeppart_cannot_use_are_named(tmp_path: Path, profile: str, message: str) -> None:
    with pytest.raises(StoreConfigError, match=message):
        profile_settings({**files(tmp_path), "AWS_PROFILE": profile})


def test_an_unsupported_source_is_no_error_when_the_environment_has_keys(tmp_path: Path) -> None:
    env = {**files(tmp_path), "AWS_PROFILE": "sso", "AWS_ACCESS_KEY_ID": "K"}
    assert profile_settings(env).config == {"region": "us-west-2"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("region = x\n", r"config: not an AWS config file"),
        ("[default]\nregion\n", r"config: not an AWS config file"),
        ("[default]\ns3 =\n  addressing_style\n", r"s3: 'addressing_style' is not 'key = value'"),
        ("[default]\ns3 =\n  addressing_style = sideways\n", r"addressing_style = sideways"),
        ("[default]\nservices = gone\n", r"services = gone: no \[services gone\] section"),
    ],
)
def test_malformed_files_are_named(tmp_path: Path, config: str, message: str) -> None:
    with pytest.raises(StoreConfigError, match=message):
        profile_settings(files(tmp_path, credentials="", config=config))


def test_a_repeated_section_or_key_reads_as_its_last(tmp_path: Path) -> None:
    """As the AWS CLI reads such files: no error, the later value wins."""
    config = "[default]\nregion = eu-west-1\nregion = eu-north-1\n[default]\nregion = us-east-2\n"
    got = profile_settings(files(tmp_path, credentials="", config=config))
    assert got.config == {"region": "us-east-2"}


def credential_script(tmp_path: Path, answer: object, code: int = 0) -> str:
    """A credential_process command: counts its runs in ``runs``, prints
    ``answer`` as JSON (or as is, if a str), exits with ``code``."""
    script = tmp_path / "creds.py"
    out = answer if isinstance(answer, str) else json.dumps(answer)
    script.write_text(
        "import sys\n"
        f"open({str(tmp_path / 'runs')!r}, 'a').write('x')\n"
        f"print({out!r})\n"
        "print('refused by the identity service', file=sys.stderr)\n"
        f"sys.exit({code})\n"
    )
    return f"{sys.executable} {script}"


def runs(tmp_path: Path) -> int:
    path = tmp_path / "runs"
    return len(path.read_text()) if path.exists() else 0


def test_credential_process_is_run_when_asked_and_kept_until_near_expiry(tmp_path: Path) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    expiration = later.isoformat().replace("+00:00", "Z")
    answer = {"Version": 1, "AccessKeyId": "PK", "SecretAccessKey": "ps",
              "SessionToken": "pt", "Expiration": expiration}  # fmt: skip
    config = f"[profile proc]\ncredential_process = {credential_script(tmp_path, answer)}\n"
    got = profile_settings({**files(tmp_path, config=config), "AWS_PROFILE": "proc"})
    assert got.config == {} and isinstance(got.credentials, ProcessCredentials)
    assert runs(tmp_path) == 0  # not before the client asks
    first = got.credentials()
    keys = (first["access_key_id"], first["secret_access_key"], first["token"])
    assert keys == ("PK", "ps", "pt")
    assert abs((first["expires_at"] - later).total_seconds()) < 1
    assert got.credentials() == first and runs(tmp_path) == 1
    # An answer about to expire is renewed at the next call.
    soon = dict(answer, Expiration=(datetime.now(UTC) + timedelta(seconds=30)).isoformat())
    proc = ProcessCredentials(credential_script(tmp_path, soon), "proc")
    proc()
    proc()
    assert runs(tmp_path) == 3
    # Environment keys come first: the process is not used.
    env = {**files(tmp_path, config=config), "AWS_PROFILE": "proc", "AWS_ACCESS_KEY_ID": "K"}
    assert profile_settings(env).credentials is None


@pytest.mark.parametrize(
    ("answer", "code", "message"),
    [
        ({"Version": 1, "AccessKeyId": "K", "SecretAccessKey": "s"}, 3,
         r"exited with 3: refused by the identity service"),
        ("not json", 0, r"its output is not JSON"),
        ({"Version": 2, "AccessKeyId": "K", "SecretAccessKey": "s"}, 0, r'"Version": 1'),
        ({"Version": 1, "AccessKeyId": "K"}, 0, r"AccessKeyId and SecretAccessKey are required"),
        ({"Version": 1, "AccessKeyId": "K", "SecretAccessKey": "s", "Expiration": "soon"}, 0,
         r"Expiration"),
    ],
)  # fmt: skip
def test_a_failing_credential_process_is_named(
    tmp_path: Path, answer: object, code: int, message: str
) -> None:
    proc = ProcessCredentials(credential_script(tmp_path, answer, code), "proc")
    named = rf"AWS profile 'proc': credential_process.*{message}"
    with pytest.raises(StoreConfigError, match=named):
        proc()
    missing = ProcessCredentials(str(tmp_path / "no-such-command"), "proc")
    with pytest.raises(StoreConfigError, match="did not run"):
        missing()
