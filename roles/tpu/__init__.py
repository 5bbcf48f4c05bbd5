"""TPU VM prerequisites: Docker for the vllm-tpu image and a /dev/shm big enough for the caches.
TPU VMs ship their driver (libtpu rides in the wheel or image), so nothing is installed for the chips."""

from __future__ import annotations

import re
import shlex

from pydantic import field_validator
from pyinfra import host
from pyinfra.api import FactBase, deploy, operation
from pyinfra.facts.files import FileContents

from gemmaserve.plan import Plan
from roles._lib.settings import RoleSettings

FSTAB = "/etc/fstab"
SHM_OPTIONS = "rw,nosuid,nodev,size={size}"
UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


class Settings(RoleSettings):
    prefix = "tpu_"
    # The least /dev/shm the XLA compile cache (VLLM_XLA_CACHE_PATH) gets. Never a shrink: a TPU VM's
    # default /dev/shm is half its RAM (the kernel's tmpfs default), far more than this on a v6e-4 host
    # (Google's v6e page gives 1536 GiB of DRAM per 8-chip host), so there nothing changes. tmpfs only
    # reserves what is written: a ceiling, not an allocation.
    shm_size: str = "128G"

    @field_validator("shm_size")
    @classmethod
    def _size(cls, value: str) -> str:
        # It lands in /etc/fstab and a mount command: exactly tmpfs's syntax, nothing around it.
        if not re.fullmatch(r"[0-9]+[KMGTkmgt]?", value):
            raise ValueError("allowed: a number with an optional K/M/G/T suffix, e.g. 128G")
        return value


class ShmSize(FactBase[int]):
    """The size of the /dev/shm tmpfs in bytes:

    .. code:: python

        137438953472
    """

    def command(self) -> str:
        return "df --block-size=1 --output=size /dev/shm | tail -n 1"

    def process(self, output: list[str]) -> int:
        return int(output[-1].strip())


def size_bytes(size: str) -> int:
    """tmpfs size syntax -> bytes: "128G" -> 137438953472."""
    match = re.fullmatch(r"(\d+)([KMGT]?)", str(size).strip().upper())
    if not match:
        raise ValueError(f"tpu_shm_size = {size!r}: expected a number with an optional K/M/G/T suffix, e.g. 128G")
    return int(match.group(1)) * UNITS.get(match.group(2), 1)


def fstab_line(size: str) -> str:
    return f"tmpfs /dev/shm tmpfs {SHM_OPTIONS.format(size=size)} 0 0"


@operation()
def shm_size(size: str):
    """Grow /dev/shm to at least `size` now (remount) and at every boot (its /etc/fstab line, which
    systemd's dev-shm.mount honours); a larger /dev/shm is left alone."""
    wanted_bytes, wanted_line = size_bytes(size), fstab_line(size)
    current = host.get_fact(ShmSize)
    if current >= wanted_bytes:
        host.noop(f"/dev/shm is {current / 1024**3:.0f} GiB, at least {size}: never shrunk")
        return
    lines = host.get_fact(FileContents, path=FSTAB) or []
    shm_lines = [line for line in lines if re.match(r"^\s*\S+\s+/dev/shm\s", line)]
    if shm_lines != [wanted_line]:
        # Drop any other /dev/shm entry, then append ours.
        yield f"sed -i -E '\\#^\\s*\\S+\\s+/dev/shm\\s#d' {FSTAB} && echo '{wanted_line}' >> {FSTAB}"
    yield f"mount -o {shlex.quote(f'remount,size={size}')} /dev/shm"


@deploy("Prepare the TPU VM", data_defaults=Settings.defaults())
def tpu(plan: Plan) -> None:
    size = Settings.from_host(host).shm_size  # a bad size fails here, before anything changes
    shm_size(name=f"Size /dev/shm to {size}", size=size)
