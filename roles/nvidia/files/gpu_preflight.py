"""Check a replica's GPUs before vLLM starts on them, so a host with a sick GPU never joins the balancer.

Runs on serving hosts (stdlib only) as the replica unit's ExecStartPre:

    python3 gpu_preflight.py [--fabric]

It reads `nvidia-smi -q` for the GPUs in CUDA_VISIBLE_DEVICES (indexes in PCI bus order, which is why
CUDA_DEVICE_ORDER must be PCI_BUS_ID) and fails, naming the GPU and the field, when:
  - the loaded kernel module is not the driver nvidia-smi talks to (or none is loaded),
  - ECC is off, a page retirement or row remap is pending (a GPU reset is due) or remapping failed,
  - MIG mode is on (vLLM wants the whole GPU),
  - on NVSwitch systems (a fabric state other than N/A, or --fabric): the GPU's fabric state is not
    Completed/Success, i.e. fabric manager has not trained the NVLink fabric (CUDA would return error 802,
    "system not yet initialized").
Persistence mode off is reported as a warning only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

PROC_VERSION = "/proc/driver/nvidia/version"


def parse_smi_q(text: str) -> tuple[dict, list[dict]]:
    """`nvidia-smi -q` -> (top-level fields, one nested dict per GPU in the order printed)."""
    top: dict = {}
    gpus: list[dict] = []
    stack: list[tuple[int, dict]] = []
    for raw in text.splitlines():
        if not raw.strip() or raw.startswith("="):
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        line = raw.strip()
        if indent == 0 and line.startswith("GPU "):
            gpu = {"Bus Id": line.split(" ", 1)[1].strip()}
            gpus.append(gpu)
            stack = [(0, gpu)]
            continue
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if indent == 0:
            if sep:
                top[key] = value
            stack = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not stack:
            continue
        parent = stack[-1][1]
        if sep and value:
            parent[key] = value
        else:
            child: dict = {}
            parent[key] = child if not sep else value
            if not sep:
                stack.append((indent, child))
    return top, gpus


def _get(gpu: dict, *path: str) -> str | None:
    node = gpu
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, str) else None


def check_gpu(index: int, gpu: dict, fabric: bool) -> tuple[list[str], list[str]]:
    """(problems, warnings) for one GPU block."""
    name = f"GPU {index} ({gpu.get('Bus Id')})"
    problems, warnings = [], []
    ecc = _get(gpu, "ECC Mode", "Current")
    if ecc == "Disabled":
        problems.append(f"{name}: ECC Mode Current = Disabled (enable it: nvidia-smi -e 1, then reset the GPU)")
    if _get(gpu, "Retired Pages", "Pending Page Blacklist") == "Yes":
        problems.append(f"{name}: Retired Pages Pending Page Blacklist = Yes (a GPU reset is due)")
    if _get(gpu, "Remapped Rows", "Pending") == "Yes":
        problems.append(f"{name}: Remapped Rows Pending = Yes (a GPU reset is due)")
    if _get(gpu, "Remapped Rows", "Remapping Failure Occurred") == "Yes":
        problems.append(f"{name}: Remapped Rows Remapping Failure Occurred = Yes (the GPU needs service)")
    if _get(gpu, "MIG Mode", "Current") == "Enabled":
        problems.append(f"{name}: MIG Mode Current = Enabled (vLLM serves whole GPUs: nvidia-smi -mig 0)")
    state, status = _get(gpu, "Fabric", "State"), _get(gpu, "Fabric", "Status")
    if fabric or state not in (None, "N/A"):
        if (state, status) != ("Completed", "Success"):
            problems.append(
                f"{name}: Fabric State = {state}, Status = {status} (expected Completed/Success: "
                "is nvidia-fabricmanager running at the driver's version?)"
            )
    if _get(gpu, "Persistence Mode") == "Disabled":
        warnings.append(f"{name}: Persistence Mode = Disabled (every start re-initialises the GPU)")
    return problems, warnings


def loaded_module_version(path: str = PROC_VERSION) -> str | None:
    try:
        with open(path) as handle:
            match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", handle.read())
    except OSError:
        return None
    return match.group(1) if match else None


def preflight(smi_text: str, module: str | None, visible: str | None, device_order: str | None, fabric: bool):
    """(problems, warnings) for the host and the visible GPUs."""
    problems, warnings = [], []
    if device_order != "PCI_BUS_ID":
        problems.append(
            f"CUDA_DEVICE_ORDER = {device_order!r}: must be PCI_BUS_ID, or CUDA's GPU numbers are not nvidia-smi's"
        )
    top, gpus = parse_smi_q(smi_text)
    driver = top.get("Driver Version")
    if module is None:
        problems.append(f"no NVIDIA kernel module is loaded ({PROC_VERSION} is missing)")
    elif driver != module:
        problems.append(f"loaded kernel module {module} differs from the driver nvidia-smi reports ({driver})")
    ordered = sorted(gpus, key=lambda g: g.get("Bus Id", ""))
    wanted = [int(i) for i in (visible or "").split(",") if i.strip()] or list(range(len(ordered)))
    for index in wanted:
        if index >= len(ordered):
            problems.append(f"GPU {index}: not present (nvidia-smi shows {len(ordered)} GPUs)")
            continue
        found, warned = check_gpu(index, ordered[index], fabric)
        problems += found
        warnings += warned
    return problems, warnings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Check this replica's GPUs before vLLM starts.")
    parser.add_argument(
        "--fabric", action="store_true", help="require fabric state Completed even where nvidia-smi reports N/A"
    )
    parser.add_argument("--nvidia-smi", default="nvidia-smi")
    parser.add_argument("--proc-version", default=PROC_VERSION)
    args = parser.parse_args(argv)
    result = subprocess.run([args.nvidia_smi, "-q"], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        print(f"gemmaserve preflight: nvidia-smi -q failed: {(result.stdout + result.stderr).strip()}", file=sys.stderr)
        return 1
    problems, warnings = preflight(
        result.stdout,
        loaded_module_version(args.proc_version),
        # A container replica's CUDA_VISIBLE_DEVICES numbers the container's GPUs; the host's are here.
        os.environ.get("GEMMASERVE_HOST_GPUS") or os.environ.get("CUDA_VISIBLE_DEVICES"),
        os.environ.get("CUDA_DEVICE_ORDER"),
        args.fabric,
    )
    for warning in warnings:
        print(f"gemmaserve preflight: warning: {warning}", file=sys.stderr)
    for problem in problems:
        print(f"gemmaserve preflight: {problem}", file=sys.stderr)
    if problems:
        return 1
    print("gemmaserve preflight: GPUs ready", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
