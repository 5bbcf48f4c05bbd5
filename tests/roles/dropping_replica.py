"""A replica that takes requests and drops them: it counts each one it receives and closes the connection unanswered.

Stands in for a vLLM replica (on its port, while that replica is stopped) so a test can count what HAProxy
delivers: `GET /health` answers 200, as a replica that is up does, so HAProxy keeps it in rotation, and `GET
/metrics` an empty exposition (the host's metrics scraper calls replicas directly); any other
request is read whole (headers and Content-Length body, so the close is a clean FIN, HAProxy's "empty
response"), counted, and its connection closed without a byte of answer. `GET /received` (not a vLLM route)
answers the counts as JSON, {"POST /v1/completions": 1}. Stdlib only; runs as a program inside a sandbox host:

    python3 dropping_replica.py --bind 127.0.0.1 --port 8000
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Received:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def json(self) -> bytes:
        with self.lock:
            return json.dumps(self.counts).encode()


def handler_for(received: Received) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _answer(self, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _drop(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.count(f"{self.command} {self.path}")
            self.close_connection = True  # handle() returns and the server closes the socket: no answer at all

        def do_GET(self) -> None:  # noqa: N802 - http.server's API
            if self.path == "/health":
                return self._answer(b"{}")
            if self.path == "/metrics":
                return self._answer(b"", "text/plain; version=0.0.4")
            if self.path == "/received":
                return self._answer(received.json())
            self._drop()

        do_POST = do_PUT = do_DELETE = _drop  # noqa: N815

    return Handler


def serve(bind: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, Received]:
    received = Received()
    server = ThreadingHTTPServer((bind, port), handler_for(received))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, received


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    serve(args.bind, args.port)
    threading.Event().wait()


if __name__ == "__main__":
    main()
