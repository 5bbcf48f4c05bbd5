"""Which distribution a host runs, and the vendor repository names for it."""

from __future__ import annotations

from collections.abc import Mapping


def distro_key(distribution: dict) -> tuple[str, str]:
    """`server.LinuxDistribution` -> (id, version), e.g. ("ubuntu", "24.04") or ("debian", "12")."""
    meta = distribution.get("release_meta") or {}
    distro_id = (meta.get("ID") or distribution.get("name") or "").lower()
    return distro_id, meta.get("VERSION_ID") or str(distribution.get("major"))


def distro_name(distribution: dict, names: Mapping[tuple[str, str], str], what: str) -> str:
    """A vendor's name for this distribution (its repository path or codename), or a clear refusal."""
    distro_id, version = distro_key(distribution)
    try:
        return names[(distro_id, version)]
    except KeyError:
        supported = ", ".join(f"{d} {v}" for d, v in names)
        raise ValueError(f"{distro_id} {version}: no {what} support in gemmaserve; supported: {supported}") from None
