"""The building blocks host programs share (stdlib only): atomic private writes, the metadata server and its
service account token, one command on HAProxy's admin socket, and sd_notify.

Installed by the base role into /opt/gemmaserve/lib, beside every program that imports it (`import hostlib`:
Python puts a script's own directory first on sys.path).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import urllib.request

# Overridable so programs can be tested against a local fake metadata server.
METADATA_URL = os.environ.get("GEMMASERVE_METADATA_URL", "http://metadata.google.internal/computeMetadata/v1")
# The metadata server is link-local and an emulator local: never through a proxy.
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
HAPROXY_SOCKET = "/run/haproxy/admin.sock"


def write_private(path: str, data: bytes | str, mode: int = 0o600) -> None:
    """Replace `path` atomically by a file holding `data`, created with `mode` before its first byte, so a
    reader never sees half a file or a moment of wider permissions; nothing is left behind on failure."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def metadata_open(path: str, timeout: float = 10):
    """A response for GET METADATA_URL/path (https://cloud.google.com/compute/docs/metadata/querying-metadata);
    urllib's HTTPError, URLError or OSError when it fails."""
    request = urllib.request.Request(f"{METADATA_URL}/{path}", headers={"Metadata-Flavor": "Google"})
    return NO_PROXY.open(request, timeout=timeout)


def metadata_token(timeout: float = 10) -> tuple[str, float]:
    """The VM's service account access token and the seconds it stays valid (300 when not said)
    (https://cloud.google.com/compute/docs/access/authenticate-workloads#applications)."""
    with metadata_open("instance/service-accounts/default/token", timeout) as response:
        body = json.loads(response.read())
    return body["access_token"], float(body.get("expires_in", 300))


def haproxy_command(line: str, path: str = HAPROXY_SOCKET) -> str:
    """One command on HAProxy's admin socket and its whole answer (HAProxy closes the connection after it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendall(line.encode() + b"\n")
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def sd_notify(message: str) -> None:
    """sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET (absent outside systemd); never fails."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(message.encode(), address)
        except OSError:
            pass
