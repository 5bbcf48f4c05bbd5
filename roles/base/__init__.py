"""Base host preparation: packages, time sync, open-file limits, the gemmaserve user and directories."""

from __future__ import annotations

from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Command
from pyinfra.operations import apt, files, server, systemd

from gemmaserve.plan import HF_HOME, STATE_DIR

DEFAULTS = {
    "base_packages": ["ca-certificates", "curl", "python3", "python3-venv", "libnuma1"],
    # Serving keeps one socket per streaming client plus model shards open: raise the limit.
    "base_nofile": 1048576,
}


@deploy("Prepare the host", data_defaults=DEFAULTS)
def base() -> None:
    virt = (host.get_fact(Command, "systemd-detect-virt --container || true") or "none").strip()
    packages = list(host.data.base_packages)
    if virt == "none":
        # Containers share the outer clock and cannot set it; real hosts sync their own.
        packages.append("chrony")
    apt.packages(name="Install base packages", packages=packages, update=True, cache_time=3600, no_recommends=True)
    if virt == "none":
        systemd.service(name="Run chrony for time sync", service="chrony", running=True, enabled=True)
    server.group(name="Create the gemmaserve group", group="gemmaserve", system=True)
    server.user(
        name="Create the gemmaserve system user", user="gemmaserve", group="gemmaserve", home=STATE_DIR,
        shell="/usr/sbin/nologin", system=True, ensure_home=False,
    )
    files.directory(name="Create /etc/gemmaserve", path="/etc/gemmaserve", user="root", group="gemmaserve", mode="0750")
    for path in (STATE_DIR, HF_HOME):
        files.directory(name=f"Create {path}", path=path, user="gemmaserve", group="gemmaserve", mode="0750")
    limit = host.data.base_nofile
    files.put(
        name="Raise open-file limits for the gemmaserve user",
        src=StringIO(f"gemmaserve soft nofile {limit}\ngemmaserve hard nofile {limit}\n"),
        dest="/etc/security/limits.d/90-gemmaserve.conf", mode="0644",
    )


def distro_key(distribution: dict) -> tuple[str, str]:
    """`server.LinuxDistribution` -> (id, version), e.g. ("ubuntu", "24.04") or ("debian", "12")."""
    meta = distribution.get("release_meta") or {}
    distro_id = (meta.get("ID") or distribution.get("name") or "").lower()
    return distro_id, meta.get("VERSION_ID") or str(distribution.get("major"))
