"""A local fake of what secret_fetch.py asks Google for: the metadata server's token and project, and one
Secret Manager secret's latest version, read from a file at each request (stdlib only).

Serves, on one port, what roles/_lib/files/secret_fetch.py reads with GEMMASERVE_METADATA_URL=BASE/computeMetadata/v1
and GEMMASERVE_SECRETMANAGER_URL=BASE/v1:

- GET /computeMetadata/v1/instance/service-accounts/default/token and .../project/project-id (the
  `Metadata-Flavor: Google` header required, https://cloud.google.com/compute/docs/metadata/querying-metadata);
- GET /v1/projects/P/secrets/NAME/versions/latest:access with that token: the file's bytes as an
  AccessSecretVersionResponse (payload.data base64, payload.dataCrc32c, as the secretmanager v1 discovery
  document defines them); any other secret is a 404.

Runs as a program inside a sandbox host:

    python3 fake_secret_manager.py --port 8998 --secret projects/P/secrets/NAME --file /path/of/the/payload
"""

from __future__ import annotations

import argparse
import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "ya29.gemmaserve-test-token"


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): what Secret Manager's dataCrc32c holds."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def handler_for(secret: str, payload_file: str) -> type[BaseHTTPRequestHandler]:
    project = secret.split("/")[1]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, code: int, body: dict | str) -> None:
            data = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "application/text")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's API
            if self.path.startswith("/computeMetadata/v1/"):
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, "Missing Metadata-Flavor:Google header.")
                if self.path.endswith("/instance/service-accounts/default/token"):
                    return self._send(200, {"access_token": TOKEN, "expires_in": 3599, "token_type": "Bearer"})
                if self.path.endswith("/project/project-id"):
                    return self._send(200, project)
                return self._send(404, "not found")
            if self.path == f"/v1/{secret}/versions/latest:access":
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, {"error": {"code": 401, "status": "UNAUTHENTICATED"}})
                with open(payload_file, "rb") as handle:
                    raw = handle.read()
                payload = {"data": base64.b64encode(raw).decode(), "dataCrc32c": str(crc32c(raw))}
                return self._send(200, {"name": f"{secret}/versions/1", "payload": payload})
            self._send(404, {"error": {"code": 404, "status": "NOT_FOUND", "message": "no such secret"}})

    return Handler


def serve(secret: str, payload_file: str, bind: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((bind, port), handler_for(secret, payload_file))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--secret", required=True, help="projects/P/secrets/NAME")
    parser.add_argument("--file", required=True, help="the latest version's payload")
    args = parser.parse_args()
    serve(args.secret, args.file, args.bind, args.port)
    threading.Event().wait()


if __name__ == "__main__":
    main()
