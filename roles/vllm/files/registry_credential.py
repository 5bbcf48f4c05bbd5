#!/usr/bin/python3
"""A container-registry credential helper for Artifact Registry: the VM's own service account, through
the metadata server, so `podman pull REGION-docker.pkg.dev/...@sha256:...` needs no stored password.

Installed by the vllm role as /usr/local/bin/docker-credential-gemmaserve-gcp (stdlib only) and named
for Artifact Registry's hosts under "credHelpers" in /etc/gemmaserve/registry-auth.json, which podman
reads with --authfile (containers-auth.json(5)). It speaks the credential-helper protocol
(https://github.com/docker/docker-credential-helpers#development):

    echo us-docker.pkg.dev | docker-credential-gemmaserve-gcp get
    {"ServerURL": "us-docker.pkg.dev", "Username": "oauth2accesstoken", "Secret": "<access token>"}

Artifact Registry takes the user `oauth2accesstoken` with a short-lived OAuth access token as the
password (https://cloud.google.com/artifact-registry/docs/docker/authentication#token); the token comes
from the metadata server (https://cloud.google.com/compute/docs/access/authenticate-workloads#applications).
Nothing is stored: `store` and `erase` are refused, `list` is empty. Errors name the registry only.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

# Overridable so the helper can be tested against a local fake metadata server (as secret_fetch.py is).
METADATA_URL = os.environ.get("GEMMASERVE_METADATA_URL", "http://metadata.google.internal/computeMetadata/v1")
USERNAME = "oauth2accesstoken"
# The metadata server is link-local: never through a proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def access_token(timeout: float = 10) -> str:
    request = urllib.request.Request(
        f"{METADATA_URL}/instance/service-accounts/default/token", headers={"Metadata-Flavor": "Google"}
    )
    with _OPENER.open(request, timeout=timeout) as response:
        return json.loads(response.read())["access_token"]


def get(server: str) -> dict[str, str]:
    return {"ServerURL": server, "Username": USERNAME, "Secret": access_token()}


def main(argv: list[str]) -> int:
    action = argv[0] if argv else ""
    if action == "list":
        print("{}")
        return 0
    if action != "get":
        # The protocol's error channel is stdout.
        print(f"docker-credential-gemmaserve-gcp: {action or 'no action'} is not supported (get, list)")
        return 1
    server = sys.stdin.read().strip()
    try:
        print(json.dumps(get(server)))
    except (urllib.error.URLError, OSError, KeyError, ValueError) as error:
        print(f"no access token for {server} from the metadata server ({error.__class__.__name__})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
