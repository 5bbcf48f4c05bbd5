"""The credentials the gcp provider uses, resolved the same way, for code that calls Google APIs itself.

pulumi-gcp (the Terraform google provider underneath) authenticates in this order
(https://www.pulumi.com/registry/packages/gcp/installation-configuration/,
https://registry.terraform.io/providers/hashicorp/google/latest/docs/guides/provider_reference):
an access token (`gcp:accessToken`, GOOGLE_OAUTH_ACCESS_TOKEN), else a credentials JSON or a path to
one (`gcp:credentials`, GOOGLE_CREDENTIALS, GOOGLE_CLOUD_KEYFILE_JSON, GCLOUD_KEYFILE_JSON), else
Application Default Credentials; then, if asked, it impersonates a service account
(`gcp:impersonateServiceAccount`, GOOGLE_IMPERSONATE_SERVICE_ACCOUNT, with
`gcp:impersonateServiceAccountDelegates`). The TPU provider and `gemmaserve capacity` follow the same
rules, so they act as the identity the rest of the stack acts as. google-auth is imported only when
credentials are built.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
DEFAULT_SCOPES = (CLOUD_PLATFORM, "https://www.googleapis.com/auth/userinfo.email")
CREDENTIAL_ENV = ("GOOGLE_CREDENTIALS", "GOOGLE_CLOUD_KEYFILE_JSON", "GCLOUD_KEYFILE_JSON")


class CredentialsError(Exception):
    """The configured credentials cannot be used; names the setting, never its value."""


@dataclass(frozen=True)
class GcpAuth:
    """Where credentials come from; `source` names the winning setting for messages (never the secret)."""

    access_token: str | None = None
    credentials: str | None = None
    impersonate: str | None = None
    delegates: tuple[str, ...] = ()
    scopes: tuple[str, ...] = DEFAULT_SCOPES
    source: str = "Application Default Credentials"

    def __repr__(self) -> str:  # keep tokens and keys out of tracebacks and logs
        return f"GcpAuth(source={self.source!r}, impersonate={self.impersonate!r})"


def _list(value: Any) -> tuple[str, ...]:
    if value in (None, ""):
        return ()
    if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith("[") else value.split(",")
    return tuple(str(v).strip() for v in value if str(v).strip())


def gcp_auth(config: Callable[[str], Any], environ: Mapping[str, str]) -> GcpAuth:
    """Resolve the gcp provider's settings: `config` reads stack config keys ("gcp:credentials")."""
    token, source = config("gcp:accessToken"), "gcp:accessToken"
    if not token and environ.get("GOOGLE_OAUTH_ACCESS_TOKEN"):
        token, source = environ["GOOGLE_OAUTH_ACCESS_TOKEN"], "GOOGLE_OAUTH_ACCESS_TOKEN"
    credentials = None
    if not token:
        credentials, source = config("gcp:credentials"), "gcp:credentials"
        for name in CREDENTIAL_ENV:
            if credentials:
                break
            credentials, source = environ.get(name), name
        if not credentials:
            source = "Application Default Credentials"
    impersonate = config("gcp:impersonateServiceAccount") or environ.get("GOOGLE_IMPERSONATE_SERVICE_ACCOUNT")
    return GcpAuth(
        access_token=token or None,
        credentials=credentials or None,
        impersonate=impersonate or None,
        delegates=_list(config("gcp:impersonateServiceAccountDelegates")),
        scopes=_list(config("gcp:scopes")) or DEFAULT_SCOPES,
        source=source,
    )


def credentials_for(auth: GcpAuth):
    """google-auth credentials for `auth` (nothing is fetched until the first API call)."""
    import google.auth
    from google.auth import impersonated_credentials
    from google.oauth2 import credentials as oauth2

    if auth.access_token:
        base = oauth2.Credentials(auth.access_token)
    elif auth.credentials:
        text = auth.credentials.strip()
        try:
            info = json.loads(text) if text.startswith("{") else json.loads(Path(text).read_text())
            base, _ = google.auth.load_credentials_from_dict(info, scopes=list(auth.scopes))
        except (OSError, ValueError, google.auth.exceptions.DefaultCredentialsError) as error:
            raise CredentialsError(
                f"{auth.source}: not a usable credentials JSON or path to one ({type(error).__name__})"
            ) from None
    else:
        base, _ = google.auth.default(scopes=list(auth.scopes))
    if auth.impersonate:
        return impersonated_credentials.Credentials(
            source_credentials=base,
            target_principal=auth.impersonate,
            target_scopes=list(auth.scopes),
            delegates=list(auth.delegates) or None,
        )
    return base
