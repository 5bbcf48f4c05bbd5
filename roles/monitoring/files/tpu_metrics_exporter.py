#!/usr/bin/env python3
"""Prometheus exporter for a TPU VM: HBM in use and duty cycle per TPU device, read from libtpu's runtime
metrics service with tpu-info's own library (the pinned tpu-info in this program's venv)."""

from __future__ import annotations

import argparse
import concurrent.futures
import http.server
import sys
import time

# libtpu serves its runtime metrics over gRPC on localhost:8431 while a framework (here vLLM) holds the
# TPU; tpu-info reads them there (tpu_info/metrics.py get_chip_usage, tpu-info 0.14.2).
LIBTPU_METRICS = "localhost:8431"
# tpu-info's calls carry no deadline; a scrape gives up on libtpu after this many seconds (below Prometheus's
# default 10 s scrape timeout) and reports it as silent.
READ_TIMEOUT = 5.0
_readers = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="libtpu")

HELP = {
    "gemmaserve_tpu_runtime_metrics_up": (
        "gauge",
        "1 when libtpu's runtime metrics service answered (a process holds the TPU), else 0.",
    ),
    "gemmaserve_tpu_hbm_used_bytes": ("gauge", "HBM in use on the TPU device (libtpu)."),
    "gemmaserve_tpu_hbm_total_bytes": ("gauge", "HBM on the TPU device (libtpu)."),
    "gemmaserve_tpu_duty_cycle_percent": (
        "gauge",
        "Share of the last sample period the TensorCore was busy (libtpu), 0-100.",
    ),
    "gemmaserve_tpu_scrape_seconds": ("gauge", "Time taken to read libtpu's metrics."),
}


def chip_type(name: str | None):
    """tpu-info's TpuChip for its short name (v5e, v6e, 7x), or what the PCI bus shows when None."""
    from tpu_info import device

    if name is None:
        return device.get_local_chips()[0]
    for chip in device.TpuChip:
        if chip.value.name == name:
            return chip
    known = ", ".join(c.value.name for c in device.TpuChip)
    raise SystemExit(f"--chip-type {name!r}: tpu-info knows {known}")


def read_usage(chip, address: str) -> list:
    """tpu-info's Usage(device_id, memory_usage, total_memory, duty_cycle_pct) per device."""
    from tpu_info import metrics

    return metrics.get_chip_usage(chip, addr=address)


def exposition(usages: list | None, seconds: float) -> str:
    """The Prometheus text format for one reading (None: libtpu did not answer)."""
    samples = [("gemmaserve_tpu_runtime_metrics_up", "", 0 if usages is None else 1)]
    for usage in usages or []:
        label = f'{{device="{int(usage.device_id)}"}}'
        samples += [
            ("gemmaserve_tpu_hbm_used_bytes", label, int(usage.memory_usage)),
            ("gemmaserve_tpu_hbm_total_bytes", label, int(usage.total_memory)),
            ("gemmaserve_tpu_duty_cycle_percent", label, float(usage.duty_cycle_pct)),
        ]
    samples.append(("gemmaserve_tpu_scrape_seconds", "", round(seconds, 6)))
    lines: list[str] = []
    for name, (kind, text) in HELP.items():
        rows = [f"{name}{label} {value}" for sample, label, value in samples if sample == name]
        if rows:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *rows]
    return "\n".join(lines) + "\n"


def scrape(chip, address: str, timeout: float = READ_TIMEOUT) -> str:
    started = time.monotonic()
    try:
        usages = _readers.submit(read_usage, chip, address).result(timeout=timeout)
    except Exception as error:  # noqa: BLE001 - any failure to read libtpu is "no data", reported as up 0
        print(f"libtpu metrics at {address}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        usages = None
    return exposition(usages, time.monotonic() - started)


def serve(listen: str, chip, address: str) -> http.server.ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics")
                return
            body = scrape(chip, address).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
            pass  # one line per scrape would flood the journal

    return http.server.ThreadingHTTPServer((host, int(port)), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:9471", help="address:port to serve /metrics on")
    parser.add_argument("--libtpu", default=LIBTPU_METRICS, help="libtpu's runtime metrics service")
    parser.add_argument("--chip-type", default=None, help="tpu-info's chip name (v5e, v6e, 7x); default: detect")
    args = parser.parse_args(argv)
    chip = chip_type(args.chip_type)
    if chip is None:
        print("no TPU chip on the PCI bus (tpu-info found none)", file=sys.stderr)
        return 1
    server = serve(args.listen, chip, args.libtpu)
    print(f"serving {chip.value.name} metrics from {args.libtpu} on http://{args.listen}/metrics", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
