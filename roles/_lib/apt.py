"""Debian packages: one batched question for what is installed, versions as Debian writes them, apt-get flags."""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt

from roles._lib.facts import InstalledPackages

# Non-interactive, keeping local config files, as unattended installs must.
APT_GET = (
    "DEBIAN_FRONTEND=noninteractive apt-get -y -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"
)


def installed_version(package: str) -> str | None:
    """The installed version of `package` (pyinfra's DebPackages, a set of versions per package), or None."""
    versions = sorted(host.get_fact(DebPackages).get(package) or [])
    return versions[-1] if versions else None


def upstream_version(version: str) -> str:
    """Debian package version -> upstream version: 1:580.95.05-1ubuntu1 -> 580.95.05."""
    return version.split(":", 1)[-1].split("-", 1)[0]


@operation()
def packages_installed(packages: list[str], installed: set[str]):
    """Install what is missing of `packages` (no recommends); package lists are refreshed first unless apt
    updated them in the last hour, so a role never relies on another's update."""
    missing = [p for p in packages if p not in installed]
    if not missing:
        host.noop(f"{', '.join(packages)} installed")
        return
    yield from apt.packages._inner(packages=packages, no_recommends=True, update=True, cache_time=3600)


def install_packages(name: str, packages: list[str]):
    """`packages_installed`, asking the host once which of `packages` it has."""
    installed = host.get_fact(InstalledPackages, packages=tuple(packages))
    return packages_installed(name=name, packages=list(packages), installed=installed)
