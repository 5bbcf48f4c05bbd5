"""Driver-role operations tested as pyinfra tests its own: JSON fixtures give args and facts, and the
commands the operation must yield; `facts_after` (the converged host) must then yield nothing."""

from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path

import pytest
from pyinfra.api import FileUploadCommand, FunctionCommand, StringCommand
from pyinfra.api.util import get_kwargs_str
from pyinfra.context import ctx_host, ctx_state

FIXTURES = Path(__file__).parent
CASES = sorted(FIXTURES.glob("*.*/*.json"))


class FakeHost:
    """What an operation sees of `pyinfra.host`: facts from the fixture, data, noop and a name."""

    name = "fixture-host"
    in_op = True

    def __init__(self, facts: dict):
        self.facts = facts
        self.noop_description: str | None = None

    def get_fact(self, fact_cls, *args, **kwargs):
        # Keys as pyinfra names facts (`deb.DebPackages`, `roles.nvidia.NvidiaKernelModule`), with
        # keyword arguments as pyinfra's own test harness keys them ("path=/etc/fstab").
        if fact_cls.name not in self.facts:
            raise KeyError(f"missing fixture fact: {fact_cls.name}")
        fact = self.facts[fact_cls.name]
        if kwargs:
            key = get_kwargs_str(kwargs)
            if key not in fact:
                raise KeyError(f"missing fixture fact: {fact_cls.name} [{key}]")
            return fact[key]
        return fact

    def noop(self, description: str) -> None:
        self.noop_description = description


class FakeState:
    """Operations here read no state; nested ops (server.reboot) need one to exist."""

    config = None


def command_json(command) -> str | list:
    if isinstance(command, str):
        return command.strip()
    if isinstance(command, StringCommand):
        return str(command.get_raw_value()).strip()
    if isinstance(command, FileUploadCommand):
        src = command.src
        return ["upload", src.getvalue() if hasattr(src, "getvalue") else str(src), command.dest]
    if isinstance(command, FunctionCommand):
        return ["function", command.function.__name__]
    raise TypeError(f"unexpected command {command!r}")


def run_op(op_path: str, args: dict, facts: dict) -> tuple[list, FakeHost]:
    module_name, op_name = op_path.rsplit(".", 1)
    op = getattr(import_module(f"roles.{module_name}"), op_name)
    host = FakeHost(facts)
    with ctx_host.use(host), ctx_state.use(FakeState()):
        commands = [command_json(c) for c in op._inner(**args)]
    return commands, host


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_operation_fixture(case: Path) -> None:
    data = json.loads(case.read_text())
    if "exception" in data:
        # Bad input fails while the operation is prepared, before any command exists.
        with pytest.raises(Exception, match=data["exception"]["match"]) as raised:
            run_op(case.parent.name, data["args"], data["facts"])
        assert type(raised.value).__name__ == data["exception"]["name"]
        return
    commands, host = run_op(case.parent.name, data["args"], data["facts"])
    assert commands == data["commands"], json.dumps(commands, indent=2)
    if not commands:
        assert host.noop_description, "an operation that changes nothing must say why (host.noop)"
        if "noop" in data:
            assert data["noop"] in host.noop_description
    if "facts_after" in data:
        # The second run against the converged host yields nothing.
        again, host = run_op(case.parent.name, data["args"], {**data["facts"], **data["facts_after"]})
        assert again == [], json.dumps(again, indent=2)
        assert host.noop_description


def test_every_change_fixture_has_a_converged_state() -> None:
    """Each operation has a no-change fixture, and each idempotent change fixture shows the second run."""
    by_op: dict[str, list[dict]] = {}
    for case in CASES:
        by_op.setdefault(case.parent.name, []).append({"file": case.name, **json.loads(case.read_text())})
    assert {
        "nvidia.driver",
        "nvidia.fabric_manager",
        "nvidia.container_toolkit",
        "nvidia.reboot_for_driver",
        "rocm.rocm_release",
        "rocm.device_groups",
        "rocm.reboot_for_amdgpu",
        "tpu.shm_size",
    } <= set(by_op)
    for op, cases in by_op.items():
        assert any(c.get("commands") == [] for c in cases), f"{op}: no no-change fixture"
        idempotent = not op.split(".")[1].startswith("reboot")
        for c in cases:
            if c.get("commands") and idempotent:
                assert "facts_after" in c, f"{op}/{c['file']}: a change fixture without facts_after"


def test_harness_fails_on_wrong_commands() -> None:
    """The harness is not vacuous: a fixture expecting the wrong commands fails."""
    case = FIXTURES / "nvidia.driver" / "ubuntu2204_fresh.json"
    data = json.loads(case.read_text())
    commands, _ = run_op("nvidia.driver", {**data["args"], "branch": 570}, data["facts"])
    assert commands != data["commands"]
    with pytest.raises(KeyError, match="missing fixture fact"):
        run_op("nvidia.driver", data["args"], {})


# Facts parse what the hosts print (samples from real hosts' /proc, df and the ROCm tree).
@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (
            [
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U22-I3-AE18-09-3)  "
                "Wed Sep 24 22:19:58 UTC 2025",
                "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)",
            ],
            {"version": "580.95.05", "open": True},
        ),
        (
            ["NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.172.08  Tue Jul  8 18:38:58 UTC 2025"],
            {"version": "570.172.08", "open": False},
        ),
        ([], None),
    ],
)
def test_nvidia_kernel_module_fact(output: list[str], expected: dict | None) -> None:
    from roles.nvidia import NvidiaKernelModule

    assert NvidiaKernelModule().process(output) == expected


def test_small_facts() -> None:
    from roles.nvidia import NvidiaDockerRuntime, NvidiaGpuCount
    from roles.rocm import AmdgpuModule, RocmVersion
    from roles.tpu import ShmSize

    assert NvidiaGpuCount().process(["8"]) == 8
    assert NvidiaDockerRuntime().process(["yes"]) is True and NvidiaDockerRuntime().process(["no"]) is False
    assert RocmVersion().process(["7.2.1-81"]) == "7.2.1-81" and RocmVersion().process([]) is None
    assert AmdgpuModule().process(["in-tree"]) == "in-tree" and AmdgpuModule().process([""]) is None
    assert ShmSize().process(["      137438953472"]) == 128 * 1024**3


def test_blackwell_cannot_use_proprietary_modules() -> None:
    from roles.nvidia import open_modules_for

    assert open_modules_for("rtx-pro-6000", None) is True
    assert open_modules_for("h100-80gb", False) is False
    with pytest.raises(ValueError, match="Blackwell"):
        open_modules_for("b200", False)


@pytest.mark.parametrize(
    ("data", "prefix", "expected"),
    [
        ({}, "nvidia", False),
        ({"gemmaserve_allow_reboot": True}, "nvidia", True),
        ({"gemmaserve_allow_reboot": True, "nvidia_allow_reboot": False}, "nvidia", False),
        ({"nvidia_allow_reboot": True}, "nvidia", True),
        ({"nvidia_allow_reboot": True}, "rocm", False),
        ({"gemmaserve_allow_reboot": False, "rocm_allow_reboot": True}, "rocm", True),
    ],
)
def test_reboot_permission(data: dict, prefix: str, expected: bool) -> None:
    from roles.nvidia import allow_reboot

    fake = FakeHost({})
    fake.data = data  # a dict answers .get() as pyinfra's HostData does
    with ctx_host.use(fake):
        assert allow_reboot(prefix) is expected


def test_rocm_installer_names() -> None:
    from roles.rocm import installer_deb

    assert installer_deb("7.2.1") == "amdgpu-install_7.2.1.70201-1_all.deb"
    assert installer_deb("7.0") == "amdgpu-install_7.0.70000-1_all.deb"


def test_fstab_edit_runs(tmp_path: Path) -> None:
    """The fstab command the tpu fixture expects really replaces the /dev/shm line (GNU sed, as on TPU VMs)."""
    import shutil
    import subprocess

    if shutil.which("sed") is None:
        pytest.fail("sed is missing")
    fstab = tmp_path / "fstab"
    fstab.write_text("LABEL=cloudimg-rootfs / ext4 defaults 0 1\ntmpfs /dev/shm tmpfs defaults,size=10g 0 0\n")
    commands, _ = run_op(
        "tpu.shm_size",
        {"size": "128G"},
        {"files.FileContents": {"path=/etc/fstab": fstab.read_text().splitlines()}, "roles.tpu.ShmSize": 0},
    )
    subprocess.run(["sh", "-c", commands[0].replace("/etc/fstab", str(fstab))], check=True)
    assert fstab.read_text() == (
        "LABEL=cloudimg-rootfs / ext4 defaults 0 1\ntmpfs /dev/shm tmpfs rw,nosuid,nodev,size=128G 0 0\n"
    )
