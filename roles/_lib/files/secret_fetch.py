"""Fetch a secret from Google Secret Manager into a tmpfs file, mode 0400, at unit start.

Runs on serving hosts as a standalone script (stdlib and hostlib, installed beside it) from the units that need a secret:
gemmaserve-hf-token.service (roles/hf_token: the Hugging Face token), gemmaserve-api-keys.service and
gemmaserve-tls.service (roles/access: the API key store and the TLS certificate):

    python3 secret_fetch.py SECRET OUT

SECRET is NAME, projects/P/secrets/NAME or projects/P/secrets/NAME/versions/V. The access token comes
from the metadata server (the VM's service account, which holds secretAccessor on this one secret);
where gcloud is installed and no metadata server answers, `gcloud secrets versions access` is used.
The secret is never printed, logged or put in an environment variable; errors name the secret only.

At boot the metadata server or the network may not answer yet: connection errors, HTTP 429 and 5xx are
retried with exponential backoff for GEMMASERVE_FETCH_TIMEOUT seconds (default 120), a progress line per
retry. Exit status 0: written; 3: Secret Manager has no such secret or no version of it (HTTP 404); 4: the
version is not enabled (HTTP 400 FAILED_PRECONDITION: disabled or destroyed); 1: any other failure. Nothing is
written unless the fetch succeeded. The payload is checked against its `dataCrc32c` (Secret Manager stores a CRC32C with every version
and returns it: SecretPayload in the secretmanager v1 discovery document), so a corrupted secret is never
written.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

# Installed beside this program by the base role (roles/_lib/files/hostlib.py).
import hostlib

# Overridable so the fetcher can be tested against a local fake of both services (the metadata server's:
# GEMMASERVE_METADATA_URL, read by hostlib).
SECRETMANAGER_URL = os.environ.get("GEMMASERVE_SECRETMANAGER_URL", "https://secretmanager.googleapis.com/v1")
FETCH_TIMEOUT = float(os.environ.get("GEMMASERVE_FETCH_TIMEOUT", "120"))
RETRYABLE_HTTP = {429, 500, 502, 503, 504}


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), what Secret Manager's dataCrc32c holds."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ _CRC32C[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


class TokenError(Exception):
    exit_status = 1


class NotFound(TokenError):
    exit_status = 3


class NotEnabled(TokenError):
    exit_status = 4


def _status(error: urllib.error.HTTPError) -> str:
    """The google.rpc status Secret Manager puts in an error body ({"error": {"status": ...}}), or ""."""
    try:
        return json.loads(error.read() or b"{}")["error"]["status"]
    except (ValueError, KeyError, TypeError, OSError):
        return ""


def _get_once(url: str, headers: dict[str, str], timeout: float = 10) -> bytes:
    with urllib.request.build_opener().open(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
        return response.read()


def _metadata(path: str) -> bytes:
    with hostlib.metadata_open(path) as response:
        return response.read()


def _get(url: str, headers: dict[str, str], deadline: float | None = None) -> bytes:
    """GET a Secret Manager URL, with _retried's retries."""
    return _retried(lambda: _get_once(url, headers), url, deadline)


def _retried(read, url: str, deadline: float | None = None):
    """read() with retries on what passes at boot (no route yet, 429, 5xx) while reaching `url`; other HTTP
    errors raise at once."""
    deadline = deadline if deadline is not None else time.monotonic() + FETCH_TIMEOUT
    delay, attempt = 1.0, 1
    while True:
        try:
            return read()
        except urllib.error.HTTPError as error:
            if error.code not in RETRYABLE_HTTP or time.monotonic() + delay > deadline:
                raise
            why = f"HTTP {error.code}"
        except (urllib.error.URLError, OSError) as error:
            if time.monotonic() + delay > deadline:
                raise
            reason = getattr(error, "reason", error)
            why = reason if isinstance(reason, str) else reason.__class__.__name__
        where = url.split("/v1/", 1)[0]
        print(f"gemmaserve: {where} not ready ({why}), retry {attempt} in {delay:.0f} s", file=sys.stderr)
        time.sleep(delay)
        delay, attempt = min(delay * 2, 15.0), attempt + 1


def resource_name(secret: str, project: str | None) -> str:
    if not secret.startswith("projects/"):
        if not project:
            raise TokenError(f"secret {secret!r} has no project and the metadata server gave none")
        secret = f"projects/{project}/secrets/{secret}"
    if "/versions/" not in secret:
        secret += "/versions/latest"
    return secret


def fetch_with_metadata(secret: str) -> bytes:
    token, _ = _retried(hostlib.metadata_token, f"{hostlib.METADATA_URL}/instance/service-accounts/default/token")
    project = None
    if not secret.startswith("projects/"):
        project_id = "project/project-id"
        project = _retried(lambda: _metadata(project_id), f"{hostlib.METADATA_URL}/{project_id}").decode().strip()
    name = resource_name(secret, project)
    try:
        body = json.loads(_get(f"{SECRETMANAGER_URL}/{name}:access", {"Authorization": f"Bearer {token}"}))
    except urllib.error.HTTPError as error:
        status = _status(error)
        message = f"Secret Manager refused {name}: HTTP {error.code}" + (f" {status}" if status else "")
        if error.code == 404:
            raise NotFound(message) from None
        if error.code == 400 and status == "FAILED_PRECONDITION":
            raise NotEnabled(f"{message} (the version is disabled or destroyed)") from None
        raise TokenError(message) from None
    return checked_payload(body.get("payload") or {}, name)


def checked_payload(payload: dict, name: str) -> bytes:
    """The secret's bytes, verified against the CRC32C Secret Manager returns with them."""
    data = base64.b64decode(payload.get("data", ""))
    if "dataCrc32c" not in payload:
        raise TokenError(f"Secret Manager returned {name} without dataCrc32c; refusing an unverified secret")
    if crc32c(data) != int(payload["dataCrc32c"]):
        raise TokenError(f"{name}: payload does not match its dataCrc32c (corrupted in transit); not written")
    return data


def fetch_with_gcloud(secret: str) -> bytes:
    name = resource_name(secret, None) if secret.startswith("projects/") else secret
    parts = name.split("/")
    args = [
        "gcloud",
        "secrets",
        "versions",
        "access",
        parts[5] if len(parts) > 5 else "latest",
        f"--secret={parts[3] if name.startswith('projects/') else name}",
    ]
    if name.startswith("projects/"):
        args.append(f"--project={parts[1]}")
    result = subprocess.run(args, capture_output=True, timeout=60)
    if result.returncode:
        raise TokenError(f"gcloud could not access secret {secret!r} (exit {result.returncode})")
    return result.stdout


def fetch(secret: str) -> bytes:
    try:
        return fetch_with_metadata(secret)
    except (urllib.error.URLError, OSError) as error:
        if shutil.which("gcloud"):
            return fetch_with_gcloud(secret)
        raise TokenError(f"no metadata server ({error.__class__.__name__}) and no gcloud to read {secret!r}") from None


def secret_body(data: bytes) -> bytes:
    """A token is one line and is written without a newline; a multi-line secret (a PEM bundle, the key
    store) keeps its final newline."""
    body = data.strip()
    return body + b"\n" if b"\n" in body else body


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: secret_fetch.py SECRET OUT", file=sys.stderr)
        return 2
    secret, out = argv
    try:
        data = fetch(secret)
        if not data.strip():
            raise TokenError(f"secret {secret!r} is empty")
        # Atomically, 0400, so a reader never sees a partial or world-readable secret.
        hostlib.write_private(out, secret_body(data), 0o400)
    except TokenError as error:
        print(f"gemmaserve: {error}", file=sys.stderr)
        return error.exit_status
    print(f"gemmaserve: secret {secret} written to {out} (0400)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
