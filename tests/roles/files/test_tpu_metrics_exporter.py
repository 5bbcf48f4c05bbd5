"""The TPU exporter against the real tpu-info (the pinned release) reading a gRPC service built from
tpu-info's own libtpu proto stubs: what Prometheus scrapes, and what it scrapes when libtpu is silent."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tpu_info.proto import tpu_metric_service_pb2 as tpu_metrics
from tpu_info.proto import tpu_metric_service_pb2_grpc as tpu_metrics_grpc

from roles._lib.programs import load_program, program_source
from roles.monitoring import Settings
from roles.monitoring.tpu import TPU_INFO_REQUIREMENTS

exporter = load_program("monitoring", "tpu_metrics_exporter")

GIB = 1024**3
# A v6e-4 serving vLLM: 31.25 GiB usable HBM per chip, most of it reserved up front (tpu-info's README shows
# "29.50 GiB / 31.25 GiB" and 100% duty cycle under load).
HBM_TOTAL = int(31.25 * GIB)
HBM_USED = [int(29.5 * GIB), int(21.5 * GIB), int(21.5 * GIB), int(21.5 * GIB)]
DUTY = [100.0, 87.5, 0.0, 42.25]


class FakeLibtpu(tpu_metrics_grpc.RuntimeMetricServiceServicer):
    """libtpu's RuntimeMetricService as tpu-info calls it, answering with one v6e-4's numbers."""

    def __init__(self):
        self.asked: list[str] = []

    def GetRuntimeMetric(self, request, context):  # noqa: N802 - the proto's name
        self.asked.append(request.metric_name)
        values = {
            "tpu.runtime.hbm.memory.total.bytes": [{"as_int": HBM_TOTAL}] * 4,
            "tpu.runtime.hbm.memory.usage.bytes": [{"as_int": used} for used in HBM_USED],
            "tpu.runtime.tensorcore.dutycycle.percent": [{"as_double": duty} for duty in DUTY],
        }.get(request.metric_name)
        if values is None:
            context.abort(grpc.StatusCode.NOT_FOUND, request.metric_name)
        # Devices out of order: tpu-info sorts them by device id.
        metrics = [
            {"attribute": {"key": "device-id", "value": {"int_attr": i}}, "gauge": values[i]} for i in (2, 0, 3, 1)
        ]
        return tpu_metrics.MetricResponse(metric={"name": request.metric_name, "metrics": metrics})


@pytest.fixture
def libtpu():
    """The fake service on a loopback port with local credentials, as tpu-info's channel expects."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = FakeLibtpu()
    tpu_metrics_grpc.add_RuntimeMetricServiceServicer_to_server(servicer, server)
    port = server.add_secure_port("localhost:0", grpc.local_server_credentials())
    server.start()
    yield f"localhost:{port}", servicer, server
    server.stop(grace=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("device", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_scrape_reports_every_device(libtpu) -> None:
    address, servicer, _ = libtpu
    text = exporter.scrape(exporter.chip_type("v6e"), address)
    got = samples(text)
    assert got[("gemmaserve_tpu_runtime_metrics_up", "")] == 1
    for device in range(4):
        assert got[("gemmaserve_tpu_hbm_used_bytes", str(device))] == HBM_USED[device]
        assert got[("gemmaserve_tpu_hbm_total_bytes", str(device))] == HBM_TOTAL
        assert got[("gemmaserve_tpu_duty_cycle_percent", str(device))] == DUTY[device]
    assert set(servicer.asked) == {
        "tpu.runtime.hbm.memory.total.bytes",
        "tpu.runtime.hbm.memory.usage.bytes",
        "tpu.runtime.tensorcore.dutycycle.percent",
    }


def test_silent_libtpu_is_up_zero_not_an_error(libtpu) -> None:
    """No process holds the TPU (vLLM down): the scrape still answers, with up 0 and no device series."""
    address, _, server = libtpu
    server.stop(grace=None).wait()
    got = samples(exporter.scrape(exporter.chip_type("v6e"), address))
    assert got[("gemmaserve_tpu_runtime_metrics_up", "")] == 0
    assert not [name for name, _ in got if name.startswith("gemmaserve_tpu_hbm")]


def test_hung_libtpu_times_out_as_silent(monkeypatch) -> None:
    """tpu-info's gRPC calls have no deadline: a libtpu that never answers costs one timeout, not the scrape."""
    release = threading.Event()
    monkeypatch.setattr(exporter, "read_usage", lambda chip, address: release.wait(30))
    started = time.monotonic()
    try:
        got = samples(exporter.scrape(exporter.chip_type("v6e"), "localhost:1", timeout=0.5))
    finally:
        release.set()
    assert got[("gemmaserve_tpu_runtime_metrics_up", "")] == 0
    assert time.monotonic() - started < 5


def test_unknown_chip_type_is_named() -> None:
    with pytest.raises(SystemExit, match="--chip-type 'v9z': tpu-info knows v2, v3, v4, v5e, v5p, v6e, 7x"):
        exporter.chip_type("v9z")


UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
PINNED = TPU_INFO_REQUIREMENTS[Settings().tpu_info_version]


def uv(*args: str, **options) -> subprocess.CompletedProcess:
    if UV is None:
        pytest.fail("uv is missing: pip install -e '.[test]' installs the pinned release")
    # Only PyPI, not this machine's pip/uv configuration (as tests/unit/test_engine_resolver.py does).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_INDEX", "UV_EXTRA", "PIP_"))}
    return subprocess.run(
        [UV, *args], capture_output=True, text=True, timeout=600, env={**env, "UV_NO_CONFIG": "1"}, **options
    )


@pytest.mark.network
@pytest.mark.parametrize("python", ["3.10", "3.12"])
def test_pinned_requirements_are_the_whole_closure(python: str) -> None:
    """The real resolver, given the role's pins, needs nothing more and changes nothing (TPU VM images carry
    Python 3.10 or 3.12): `pip install --no-deps` of these lines is a complete, consistent tpu-info."""
    result = uv(
        "pip", "compile", "-", "--no-header", "--no-annotate", "--quiet", "--no-python-downloads",
        "--python-version", python, "--python-platform", "x86_64-manylinux_2_28",
        "--index-url", "https://pypi.org/simple",
        input="\n".join(PINNED) + "\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "==" in line) == sorted(PINNED)


@pytest.fixture(scope="module")
def pinned_python(tmp_path_factory) -> str:
    """A venv holding exactly the role's pins (from PyPI, as the role installs them on a TPU VM)."""
    venv = tmp_path_factory.mktemp("tpu-info") / "venv"
    made = uv("venv", "--quiet", "--python", sys.executable, str(venv))
    assert made.returncode == 0, made.stderr
    installed = uv(
        "pip", "install", "--quiet", "--no-deps", "--python", str(venv / "bin" / "python"),
        "--index-url", "https://pypi.org/simple", *PINNED,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    return str(venv / "bin" / "python")


@pytest.mark.parametrize("python", ["this venv", pytest.param("the role's pins", marks=pytest.mark.network)])
def test_program_serves_metrics_over_http(libtpu, python, request) -> None:
    """The program as systemd runs it (its own process, flags as the unit passes them), scraped over HTTP;
    under the role's exact pins too (protobuf 7 reading tpu-info's generated code)."""
    address, _, _ = libtpu
    interpreter = sys.executable if python == "this venv" else request.getfixturevalue("pinned_python")
    listen = f"127.0.0.1:{free_port()}"
    program = subprocess.Popen(
        [interpreter, str(program_source("monitoring", "tpu_metrics_exporter.py")), "--listen", listen]
        + ["--libtpu", address, "--chip-type", "v6e"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, body = time.monotonic() + 20, None
        while body is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{listen}/metrics", timeout=5) as response:
                    body = response.read().decode()
                    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            except OSError:
                assert program.poll() is None, program.stdout.read()
                time.sleep(0.2)
        assert body is not None, "the exporter never answered"
        assert samples(body)[("gemmaserve_tpu_hbm_used_bytes", "0")] == HBM_USED[0]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://{listen}/", timeout=5)
    finally:
        program.terminate()
        program.wait(timeout=10)


def test_scrapes_in_parallel_threads(libtpu) -> None:
    """Concurrent scrapes each get a whole answer (ThreadingHTTPServer; each reads libtpu itself)."""
    address, _, _ = libtpu
    server = exporter.serve("127.0.0.1:0", exporter.chip_type("v6e"), address)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        bodies = []
        workers = [
            threading.Thread(
                target=lambda: bodies.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
            )
            for _ in range(4)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=30)
        assert len(bodies) == 4 and all(b"gemmaserve_tpu_duty_cycle_percent" in b for b in bodies)
    finally:
        server.shutdown()
        server.server_close()
