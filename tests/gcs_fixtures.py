"""A real GCS API emulator (fake-gcs-server) on loopback for the mirror and the host programs' tests."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Emulator:
    endpoint: str
    data: Path  # the filesystem backend's root: <bucket>/<object name> files

    def backing_file(self, bucket: str, name: str) -> Path:
        """The file holding an object's bytes, to corrupt it as a failing disk would (same generation)."""
        [path] = [p for p in (self.data / bucket).rglob("*") if p.is_file() and name in urllib.parse.unquote(str(p))]
        return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory):
    """fake-gcs-server on 127.0.0.1 (its own data directory), with STORAGE_EMULATOR_HOST set for the session."""
    from gemmaserve.sandbox.bucket import answering, emulator_argv

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    data = tmp_path_factory.mktemp("gcs")
    process = subprocess.Popen(
        emulator_argv("127.0.0.1", port, data),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not answering(endpoint):
        assert process.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
        time.sleep(0.05)
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    try:
        yield Emulator(endpoint, data)
    finally:
        process.terminate()
        process.wait(10)
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous


@pytest.fixture
def bucket(gcs_emulator, request):
    """A fresh bucket per test, through the real google-cloud-storage client."""
    from gemmaserve.ops.weights import storage_client

    name = f"t-{request.node.name.lower().replace('_', '-')[:40].strip('-')}-{time.monotonic_ns() % 10**6}"
    return storage_client().create_bucket(name)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint-shaped directory: safetensors weights (LFS on the hub) and small JSON files."""
    root = tmp_path_factory.mktemp("model")
    (root / "model-00001-of-00002.safetensors").write_bytes(os.urandom(3 * 2**20 + 17))
    (root / "model-00002-of-00002.safetensors").write_bytes(os.urandom(5 * 2**20 + 5))
    (root / "config.json").write_text('{"architectures": ["Gemma4ForConditionalGeneration"]}\n')
    (root / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (root / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    return root
