"""Base host preparation: packages, time sync, open-file limits, the gemmaserve user and directories."""

from __future__ import annotations

from pydantic import Field
from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.facts.server import Command
from pyinfra.operations import server

from gemmaserve.plan import HF_HOME, STATE_DIR
from roles._lib.apt import install_packages
from roles._lib.facts import HostState
from roles._lib.managed import managed_directory, managed_file, managed_service
from roles._lib.settings import DebianPackage, RoleSettings

LIMITS = "/etc/security/limits.d/90-gemmaserve.conf"
SERVICE_USER = "gemmaserve"


class Settings(RoleSettings):
    prefix = "base_"
    packages: tuple[DebianPackage, ...] = ("ca-certificates", "curl", "python3", "python3-venv", "libnuma1")
    # Serving keeps one socket per streaming client plus model shards open: raise the limit.
    nofile: int = Field(1048576, ge=1024, le=1073741816)  # at most the kernel's nr_open ceiling


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
    now = HostState(host, paths=["/etc/gemmaserve", STATE_DIR, HF_HOME, LIMITS], units=["chrony.service"])
    if virt == "none":
        managed_service(name="Run chrony for time sync", service="chrony.service", current=now.unit("chrony.service"))
    account = (host.get_fact(Command, "getent group gemmaserve; getent passwd gemmaserve || true") or "").splitlines()
    service_account(name="Create the gemmaserve system user", account=account)
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
