"""Base host preparation: packages, time sync, open-file limits, the gemmaserve user, the weights disk,
directories, and /opt/gemmaserve/lib with what host programs share."""

from __future__ import annotations

import re

from pydantic import Field, field_validator
from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.facts.server import Command
from pyinfra.operations import server

from gemmaserve.plan import HF_HOME, STATE_DIR
from gemmaserve.sources import capacity_from_host_data
from roles._lib.apt import install_packages
from roles._lib.facts import HostState
from roles._lib.managed import install_programs, managed_directory, managed_file, managed_service, program_paths
from roles._lib.programs import LIB_DIR
from roles._lib.settings import DebianPackage, RoleSettings
from roles.base.disk import GCE_WEIGHTS_DEVICE, TPU_WEIGHTS_DEVICE, weights_disk

LIMITS = "/etc/security/limits.d/90-gemmaserve.conf"
SERVICE_USER = "gemmaserve"
# A block device's path: /dev/ and '/'-separated names of A-Z, a-z, 0-9, '.', '_', ':' and '-' (no '.' or '..').
DEVICE_PATH = re.compile(r"/dev(/(?!\.\.?(/|$))[A-Za-z0-9._:-]+)+")


class Settings(RoleSettings):
    prefix = "base_"
    packages: tuple[DebianPackage, ...] = ("ca-certificates", "curl", "python3", "python3-venv", "libnuma1")
    # Serving keeps one socket per streaming client plus model shards open: raise the limit.
    nofile: int = Field(1048576, ge=1024, le=1073741816)  # at most the kernel's nr_open ceiling
    # The disk the state directory (weights, the HF cache, compile caches) is mounted from. "auto": the disk
    # the stack attaches, by how the host was bought (gemmaserve_capacity.kind, from the stack's hosts
    # output): a GPU VM's `weights` disk, a TPU VM's data disk; a static host (the sandbox's) has none, and
    # a cloud host without the disk (local-ssd or `none` weights_disk) keeps the boot disk. "none": never
    # mount one. A /dev/... path: that disk, which must then exist.
    weights_device: str = "auto"

    @field_validator("weights_device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value in ("auto", "none"):
            return value
        if DEVICE_PATH.fullmatch(value):
            return value
        raise ValueError(
            "allowed: auto, none, or a block device's path under /dev/ such as /dev/disk/by-id/google-weights"
        )


def weights_device_for(settings: Settings, host_data: dict, host_name: str) -> str | None:
    """The weights disk's stable path on this host, or None when it has none (base_weights_device)."""
    if settings.weights_device == "none":
        return None
    if settings.weights_device != "auto":
        return settings.weights_device
    kind = capacity_from_host_data(host_data, host_name).kind
    return {"gce-vm": GCE_WEIGHTS_DEVICE, "tpu-vm": TPU_WEIGHTS_DEVICE}.get(kind)


@operation()
def service_account(account: list[str]):
    """The gemmaserve system user and group, home STATE_DIR, no login shell."""
    expected_user = f":{STATE_DIR}:/usr/sbin/nologin"
    if (
        len(account) == 2
        and account[0].startswith(f"{SERVICE_USER}:")
        and account[1].endswith(expected_user)
        and account[1].split(":")[3] == account[0].split(":")[2]
    ):
        host.noop(f"the {SERVICE_USER} user and group exist")
        return
    yield from server.group._inner(group=SERVICE_USER, system=True)
    yield from server.user._inner(
        user=SERVICE_USER,
        group=SERVICE_USER,
        home=STATE_DIR,
        shell="/usr/sbin/nologin",
        system=True,
        ensure_home=False,
    )


@deploy("Prepare the host", data_defaults=Settings.defaults())
def base() -> None:
    settings = Settings.from_host(host)
    virt = (host.get_fact(Command, "systemd-detect-virt --container || true") or "none").strip()
    wanted = list(settings.packages)
    if virt == "none":
        # Containers share the outer clock and cannot set it; real hosts sync their own.
        wanted.append("chrony")
    install_packages("Install base packages", wanted)
    now = HostState(
        host,
        paths=["/etc/gemmaserve", STATE_DIR, HF_HOME, LIMITS, LIB_DIR, *program_paths("base")],
        units=["chrony.service"],
    )
    if virt == "none":
        managed_service(name="Run chrony for time sync", service="chrony.service", current=now.unit("chrony.service"))
    account = (host.get_fact(Command, "getent group gemmaserve; getent passwd gemmaserve || true") or "").splitlines()
    service_account(name="Create the gemmaserve system user", account=account)
    # Before the state directory is made: the disk is mounted there, and what the directory already held is
    # copied onto a freshly made file system first.
    device = weights_device_for(settings, host.data.dict(), host.name)
    weights_disk(
        name=f"Mount the weights disk at {STATE_DIR}",
        device=device,
        mount_point=STATE_DIR,
        required=settings.weights_device not in ("auto", "none"),
    )
    managed_directory(
        name="Create /etc/gemmaserve",
        path="/etc/gemmaserve",
        current=now.path("/etc/gemmaserve"),
        group=SERVICE_USER,
        mode="0750",
    )
    for path in (STATE_DIR, HF_HOME):
        managed_directory(
            name=f"Create {path}", path=path, current=now.path(path), user=SERVICE_USER, group=SERVICE_USER,
            mode="0750",
        )  # fmt: skip
    managed_file(
        name="Raise open-file limits for the gemmaserve user",
        dest=LIMITS,
        current=now.path(LIMITS),
        content=f"gemmaserve soft nofile {settings.nofile}\ngemmaserve hard nofile {settings.nofile}\n",
    )
    # What other roles' host programs import or run beside themselves (hostlib, gcs_json, secret_fetch), once,
    # before any of them installs a program.
    install_programs("base", now)
