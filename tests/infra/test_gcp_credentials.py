"""The TPU provider authenticates as the gcp provider does (issue 12, defect 10): same settings, same order."""

from __future__ import annotations

import json

import google.auth
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.auth import impersonated_credentials
from google.oauth2 import service_account
from pulumi.dynamic import ConfigureRequest
from pulumi.dynamic.config import Config

from gemmaserve.cloud.gcp_credentials import CredentialsError, credentials_for, gcp_auth
from gemmaserve.cloud.tpu_queued_resource import QueuedResourceProvider

DEPLOYER = "deployer@gemmaserve-test.iam.gserviceaccount.com"
KEY_EMAIL = "ci-key@gemmaserve-test.iam.gserviceaccount.com"


@pytest.fixture(scope="module")
def key_json() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return json.dumps(
        {
            "type": "service_account",
            "project_id": "gemmaserve-test",
            "private_key_id": "0123456789abcdef",
            "private_key": pem,
            "client_email": KEY_EMAIL,
            "client_id": "1",
            "token_uri": "https://oauth2.googleapis.com/token",
        }
    )


@pytest.fixture
def no_adc(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Application Default Credentials used although the gcp provider is configured")

    monkeypatch.setattr(google.auth, "default", refuse)


def config(values: dict) -> ConfigureRequest:
    return ConfigureRequest(Config(values, "gemmaserve"))


def http_credentials(api):
    return api._service._http.credentials


def test_provider_impersonates_with_the_stack_credentials(key_json, no_adc):
    provider = QueuedResourceProvider()
    provider.configure(config({"gcp:credentials": key_json, "gcp:impersonateServiceAccount": DEPLOYER}))
    credentials = http_credentials(provider._api())
    assert isinstance(credentials, impersonated_credentials.Credentials)
    assert credentials.service_account_email == DEPLOYER
    assert credentials._source_credentials.service_account_email == KEY_EMAIL


def test_provider_uses_google_credentials_from_the_environment(key_json, no_adc, monkeypatch):
    monkeypatch.setenv("GOOGLE_CREDENTIALS", key_json)
    provider = QueuedResourceProvider()
    provider.configure(config({}))
    credentials = http_credentials(provider._api())
    assert isinstance(credentials, service_account.Credentials) and credentials.service_account_email == KEY_EMAIL


@pytest.mark.parametrize(
    "values, environ, source, impersonate",
    [
        ({}, {}, "Application Default Credentials", None),
        ({"gcp:accessToken": "ya29.config"}, {"GOOGLE_OAUTH_ACCESS_TOKEN": "ya29.env"}, "gcp:accessToken", None),
        ({}, {"GOOGLE_OAUTH_ACCESS_TOKEN": "ya29.env", "GOOGLE_CREDENTIALS": "{}"}, "GOOGLE_OAUTH_ACCESS_TOKEN", None),
        ({"gcp:credentials": "/k.json"}, {"GOOGLE_CREDENTIALS": "{}"}, "gcp:credentials", None),
        (
            {},
            {"GCLOUD_KEYFILE_JSON": "/k.json", "GOOGLE_CLOUD_KEYFILE_JSON": "/j.json"},
            "GOOGLE_CLOUD_KEYFILE_JSON",
            None,
        ),
        ({}, {"GOOGLE_IMPERSONATE_SERVICE_ACCOUNT": DEPLOYER}, "Application Default Credentials", DEPLOYER),
        (
            {"gcp:impersonateServiceAccount": DEPLOYER},
            {"GOOGLE_IMPERSONATE_SERVICE_ACCOUNT": "other@p.iam.gserviceaccount.com"},
            "Application Default Credentials",
            DEPLOYER,
        ),
    ],
)
def test_settings_are_read_in_the_gcp_providers_order(values, environ, source, impersonate):
    auth = gcp_auth(values.get, environ)
    assert (auth.source, auth.impersonate) == (source, impersonate)


def test_delegates_and_scopes():
    auth = gcp_auth(
        {
            "gcp:impersonateServiceAccountDelegates": '["a@p.iam.gserviceaccount.com"]',
            "gcp:scopes": '["https://www.googleapis.com/auth/cloud-platform"]',
        }.get,
        {},
    )
    assert auth.delegates == ("a@p.iam.gserviceaccount.com",)
    assert auth.scopes == ("https://www.googleapis.com/auth/cloud-platform",)


def test_an_access_token_is_used_as_is(no_adc):
    credentials = credentials_for(gcp_auth({"gcp:accessToken": "ya29.token"}.get, {}))
    assert credentials.token == "ya29.token"


def test_bad_credentials_name_the_setting_never_the_value(no_adc):
    secret = '{"type": "service_account", "private_key": "SECRET-KEY-MATERIAL"}'
    auth = gcp_auth({"gcp:credentials": secret}.get, {})
    with pytest.raises(CredentialsError) as caught:
        credentials_for(auth)
    assert "gcp:credentials" in str(caught.value)
    assert "SECRET-KEY-MATERIAL" not in str(caught.value) and "SECRET-KEY-MATERIAL" not in repr(auth)


def test_capacity_reads_the_clouds_with_the_stack_credentials(key_json, no_adc):
    """`gemmaserve capacity` builds its TPU and Compute clients from the stack's config the same way."""
    from gemmaserve.ops.capacity import google_clouds

    clouds = google_clouds({"gcp:credentials": key_json, "gcp:impersonateServiceAccount": DEPLOYER})
    for credentials in (clouds.tpu._service._http.credentials, clouds.compute._instances._http.credentials):
        assert isinstance(credentials, impersonated_credentials.Credentials)
        assert credentials.service_account_email == DEPLOYER
