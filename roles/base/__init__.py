"""Base host preparation: packages, time sync, open-file limits, the gemmaserve user and directories."""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Command
from pyinfra.operations import server

from gemmaserve.plan import HF_HOME, STATE_DIR
from roles.batch import Snapshot, packages

DEFAULTS = {
    "base_packages": ["ca-certificates", "curl", "python3", "python3-venv", "libnuma1"],
    # Serving keeps one socket per streaming client plus model shards open: raise the limit.
    "base_nofile": 1048576,
}


@deploy("Prepare the host", data_defaults=DEFAULTS)
def base() -> None:
    virt = (host.get_fact(Command, "systemd-detect-virt --container || true") or "none").strip()
    wanted = list(host.data.base_packages)
    if virt == "none":
        # Containers share the outer clock and cannot set it; real hosts sync their own.
        wanted.append("chrony")
    packages(name="Install base packages", packages=wanted)
    limits = "/etc/security/limits.d/90-gemmaserve.conf"
    now = Snapshot(paths=["/etc/gemmaserve", STATE_DIR, HF_HOME, limits], units=["chrony.service"])
    if virt == "none":
        now.service(name="Run chrony for time sync", service="chrony.service", running=True, enabled=True)
    account = (host.get_fact(Command, "getent group gemmaserve; getent passwd gemmaserve || true") or "").splitlines()
    expected_user = f":{STATE_DIR}:/usr/sbin/nologin"
    if not (
        len(account) == 2
        and account[0].startswith("gemmaserve:")
        and account[1].endswith(expected_user)
        and account[1].split(":")[3] == account[0].split(":")[2]
    ):
        server.group(name="Create the gemmaserve group", group="gemmaserve", system=True)
        server.user(
            name="Create the gemmaserve system user",
            user="gemmaserve",
            group="gemmaserve",
            home=STATE_DIR,
            shell="/usr/sbin/nologin",
            system=True,
            ensure_home=False,
        )
    now.directory(name="Create /etc/gemmaserve", path="/etc/gemmaserve", user="root", group="gemmaserve", mode="0750")
    for path in (STATE_DIR, HF_HOME):
        now.directory(name=f"Create {path}", path=path, user="gemmaserve", group="gemmaserve", mode="0750")
    limit = host.data.base_nofile
    now.put(
        name="Raise open-file limits for the gemmaserve user",
        dest=limits,
        content=f"gemmaserve soft nofile {limit}\ngemmaserve hard nofile {limit}\n",
    )


def distro_key(distribution: dict) -> tuple[str, str]:
    """`server.LinuxDistribution` -> (id, version), e.g. ("ubuntu", "24.04") or ("debian", "12")."""
    meta = distribution.get("release_meta") or {}
    distro_id = (meta.get("ID") or distribution.get("name") or "").lower()
    return distro_id, meta.get("VERSION_ID") or str(distribution.get("major"))
