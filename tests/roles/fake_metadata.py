"""A local fake of the GCE metadata server's notice keys, for the preemption drain (stdlib only).

Serves /computeMetadata/v1/instance/preempted and /computeMetadata/v1/instance/maintenance-event as the
real server does (https://cloud.google.com/compute/docs/metadata/querying-metadata): the
`Metadata-Flavor: Google` header is required, every value has an ETag, and `?wait_for_change=true`
hangs until the value changes, returns at once when `last_etag` is already stale, and gives up after
`timeout_sec`. `PUT /control/<key>` (not part of the real API) sets a value: the test's flip.

Runs in-process in unit tests (`serve(port=0)`) and as a program inside a sandbox host:

    python3 fake_metadata.py --bind 127.0.0.1 --port 8999
"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PREFIX = "/computeMetadata/v1/"
DEFAULTS = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}


class Values:
    def __init__(self) -> None:
        self.values = dict(DEFAULTS)
        self.versions = dict.fromkeys(DEFAULTS, 1)
        self.changed = threading.Condition()

    def etag(self, key: str) -> str:
        return f"{abs(hash(key)) % 10**6:06d}{self.versions[key]:08d}"

    def set(self, key: str, value: str) -> None:
        with self.changed:
            if self.values.get(key) != value:
                self.values[key] = value
                self.versions[key] = self.versions.get(key, 0) + 1
            self.changed.notify_all()


def handler_for(values: Values) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, code: int, body: str, etag: str | None = None) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Metadata-Flavor", "Google")
            self.send_header("Content-Type", "application/text")
            if etag:
                self.send_header("ETag", etag)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's API
            url = urlparse(self.path)
            key = url.path.removeprefix(PREFIX)
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "Missing Metadata-Flavor:Google header.")
            if not url.path.startswith(PREFIX) or key not in values.values:
                return self._send(404, "not found")
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if query.get("wait_for_change") == "true":
                timeout = float(query.get("timeout_sec", 300))
                last = query.get("last_etag")
                with values.changed:
                    start = values.etag(key)
                    if last is None or last == start:
                        values.changed.wait_for(lambda: values.etag(key) != start, timeout=timeout)
            with values.changed:
                self._send(200, values.values[key], values.etag(key))

        def do_PUT(self) -> None:  # noqa: N802
            key = urlparse(self.path).path.removeprefix("/control/")
            if key not in values.values:
                return self._send(404, "not found")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode().strip()
            values.set(key, body)
            self._send(200, body, values.etag(key))

    return Handler


def serve(bind: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, Values]:
    values = Values()
    server = ThreadingHTTPServer((bind, port), handler_for(values))
    server.daemon_threads = True
    # serve_forever's default 0.5 s poll is what shutdown() waits for, at every teardown.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8999)
    args = parser.parse_args()
    server, _ = serve(args.bind, args.port)
    threading.Event().wait()


if __name__ == "__main__":
    main()
