"""Fetch a secret from Google Secret Manager into a tmpfs file, mode 0400, at unit start.

Runs on serving hosts as a standalone script (stdlib only) from the units that need a secret:
gemmaserve-hf-token.service (roles/secrets: the Hugging Face token), gemmaserve-api-keys.service and
gemmaserve-tls.service (roles/access: the API key store and the TLS certificate):

    python3 secret_fetch.py SECRET OUT

SECRET is NAME, projects/P/secrets/NAME or projects/P/secrets/NAME/versions/V. The access token comes
from the metadata server (the VM's service account, which holds secretAccessor on this one secret);
where gcloud is installed and no metadata server answers, `gcloud secrets versions access` is used.
The secret is never printed, logged or put in an environment variable; errors name the secret only.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

# Overridable so the fetcher can be tested against a local fake of both services.
METADATA_URL = os.environ.get("GEMMASERVE_METADATA_URL", "http://metadata.google.internal/computeMetadata/v1")
SECRETMANAGER_URL = os.environ.get("GEMMASERVE_SECRETMANAGER_URL", "https://secretmanager.googleapis.com/v1")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class TokenError(Exception):
    pass


def _get(url: str, headers: dict[str, str], timeout: float = 10) -> bytes:
    request = urllib.request.Request(url, headers=headers)
    opener = _OPENER if url.startswith(METADATA_URL) else urllib.request.build_opener()
    with opener.open(request, timeout=timeout) as response:
        return response.read()


def resource_name(secret: str, project: str | None) -> str:
    if not secret.startswith("projects/"):
        if not project:
            raise TokenError(f"secret {secret!r} has no project and the metadata server gave none")
        secret = f"projects/{project}/secrets/{secret}"
    if "/versions/" not in secret:
        secret += "/versions/latest"
    return secret


def fetch_with_metadata(secret: str) -> bytes:
    flavor = {"Metadata-Flavor": "Google"}
    token = json.loads(_get(f"{METADATA_URL}/instance/service-accounts/default/token", flavor))["access_token"]
    project = None
    if not secret.startswith("projects/"):
        project = _get(f"{METADATA_URL}/project/project-id", flavor).decode().strip()
    name = resource_name(secret, project)
    try:
        body = json.loads(_get(f"{SECRETMANAGER_URL}/{name}:access", {"Authorization": f"Bearer {token}"}))
    except urllib.error.HTTPError as error:
        raise TokenError(f"Secret Manager refused {name}: HTTP {error.code}") from None
    return base64.b64decode(body["payload"]["data"])


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


def write_private(data: bytes, out: str) -> None:
    """Write atomically, 0400, so a reader never sees a partial or world-readable secret."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out) or ".", prefix=".secret.")
    # A token is one line and is written without a newline; a multi-line secret (a PEM bundle, the key
    # store) keeps its final newline.
    body = data.strip()
    if b"\n" in body:
        body += b"\n"
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o400)
            handle.write(body)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: secret_fetch.py SECRET OUT", file=sys.stderr)
        return 2
    secret, out = argv
    try:
        data = fetch(secret)
        if not data.strip():
            raise TokenError(f"secret {secret!r} is empty")
        write_private(data, out)
    except TokenError as error:
        print(f"gemmaserve: {error}", file=sys.stderr)
        return 1
    print(f"gemmaserve: secret {secret} written to {out} (0400)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
