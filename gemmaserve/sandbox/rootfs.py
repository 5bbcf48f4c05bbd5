"""Build, cache and unpack the Debian bookworm root filesystem that sandbox hosts boot."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

SUITE = "bookworm"
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")
CACHE_DIR = Path(os.environ.get("GEMMASERVE_SANDBOX_CACHE", "/var/cache/gemmaserve/sandbox"))

# systemd..ca-certificates make a bootable host reachable by ssh; the rest is what the
# roles need on a CPU host: libnuma1 for the vLLM CPU build, curl for health checks,
# python3-venv/pip so pip can be run (and reach PyPI) inside a host.
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-venv",
    "python3-pip",
    "sudo",
    "iproute2",
    "ca-certificates",
    "libnuma1",
    "curl",
    "procps",
)

# Timers that grab the dpkg lock at random and would race a deploy.
MASKED_UNITS = ("apt-daily.timer", "apt-daily-upgrade.timer")

# Tools the sandbox drives on the outer machine, and the Debian package of each.
OUTER_TOOLS = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "nft": "nftables",
    "zstd": "zstd",
    "ip": "iproute2",
    "nsenter": "util-linux",
    "ssh": "openssh-client",
}

Log = Callable[[str], None]


@dataclass(frozen=True)
class AptSource:
    """One deb822 stanza (or sources.list line) for a Debian bookworm suite."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None = None

    def deb822(self) -> str:
        lines = [
            "Types: deb",
            f"URIs: {self.uri}",
            f"Suites: {' '.join(self.suites)}",
            f"Components: {' '.join(self.components)}",
        ]
        if self.signed_by:
            lines.append(f"Signed-By: {self.signed_by}")
        return "\n".join(lines) + "\n"


def ensure_outer_tools(log: Log, tools: Mapping[str, str] = OUTER_TOOLS) -> None:
    """Install the outer machine's missing tools ({command: Debian package}) with apt, saying what is installed."""
    missing = sorted({pkg for tool, pkg in tools.items() if shutil.which(tool) is None})
    if not missing:
        return
    log(f"installing on the outer machine: {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True, stdout=subprocess.DEVNULL)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


_ONE_LINE = re.compile(r"^deb\s+(?:\[(?P<options>[^\]]*)\]\s+)?(?P<uri>\S+)\s+(?P<suite>\S+)\s*(?P<components>.*)$")


def outer_apt_sources(etc: Path = Path("/etc/apt")) -> list[AptSource]:
    """The Debian bookworm sources this machine already uses (never hard-coded here)."""
    sources: list[AptSource] = []
    for path in sorted((etc / "sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[:1].isspace():
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
                continue
            sources += _bookworm_only(
                fields.get("uris", "").split(),
                fields.get("suites", "").split(),
                fields.get("components", "").split(),
                fields.get("signed-by"),
            )
    lists = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.list"))]
    for path in lists:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            match = _ONE_LINE.match(line.split("#", 1)[0].strip())
            if not match:
                continue
            options = dict(o.partition("=")[::2] for o in (match["options"] or "").split())
            sources += _bookworm_only(
                [match["uri"]], [match["suite"]], match["components"].split(), options.get("signed-by")
            )
    return sources


def _bookworm_only(uris: list[str], suites: list[str], components: list[str], signed_by: str | None) -> list[AptSource]:
    # Keep only Debian's own bookworm suites: third-party repositories stay on the outer machine.
    wanted = tuple(s for s in suites if s == SUITE or s.startswith(f"{SUITE}-"))
    keyring = signed_by if signed_by and signed_by.startswith("/usr/share/keyrings/debian-archive") else None
    if not wanted or (signed_by and keyring is None):
        return []
    return [AptSource(uri, wanted, tuple(components) or ("main",), keyring) for uri in uris]


def main_mirror(sources: list[AptSource]) -> AptSource:
    for source in sources:
        if SUITE in source.suites:
            return source
    raise RuntimeError(f"no Debian {SUITE} source in /etc/apt/sources.list*; the sandbox uses the machine's mirror")


def cache_key(sources: list[AptSource]) -> str:
    """Hash of everything that shapes the cached rootfs: packages, sources and this recipe."""
    recipe = inspect.getsource(_debootstrap) + inspect.getsource(_finish_template)
    blob = json.dumps(
        {
            "suite": SUITE,
            "packages": sorted(PACKAGES),
            "masked": sorted(MASKED_UNITS),
            "sources": [s.deb822() for s in sources],
            "ca_certs": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in _extra_ca_certs()},
            "recipe": recipe,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _extra_ca_certs() -> list[Path]:
    return sorted(p for p in EXTRA_CA_DIR.rglob("*.crt") if p.is_file()) if EXTRA_CA_DIR.is_dir() else []


def cached_rootfs(log: Log) -> Path:
    """The zstd tarball of the generic rootfs, built with debootstrap on a cache miss."""
    sources = outer_apt_sources()
    tarball = CACHE_DIR / f"rootfs-{SUITE}-{cache_key(sources)}.tar.zst"
    if tarball.exists():
        log(f"rootfs cache hit: {tarball}")
        return tarball
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    build = CACHE_DIR / f"build-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    started = time.monotonic()
    try:
        log(f"building the rootfs with debootstrap (cache miss, about 70 s): {len(PACKAGES)} packages")
        _debootstrap(build, main_mirror(sources))
        _finish_template(build, sources)
        log(f"packing the rootfs cache {tarball.name}")
        partial = tarball.with_suffix(".partial")
        subprocess.run(
            [
                "tar",
                "-C",
                str(build),
                "--numeric-owner",
                "--xattrs",
                "--xattrs-include=*",
                "--acls",
                "-I",
                "zstd -T0 -3",
                "-cpf",
                str(partial),
                ".",
            ],
            check=True,
        )
        partial.replace(tarball)
        for stale in CACHE_DIR.glob(f"rootfs-{SUITE}-*.tar.zst"):
            if stale != tarball:
                stale.unlink()  # a changed recipe or package list makes older builds dead weight
    finally:
        shutil.rmtree(build, ignore_errors=True)
    log(f"rootfs built and cached in {time.monotonic() - started:.1f} s")
    return tarball


def _debootstrap(target: Path, mirror: AptSource) -> None:
    cmd = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(PACKAGES)}",
        f"--components={','.join(mirror.components)}",
    ]
    if mirror.signed_by:
        cmd.append(f"--keyring={mirror.signed_by}")
    cmd += [SUITE, str(target), mirror.uri]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise RuntimeError(f"debootstrap failed (exit {proc.returncode}); see {target}/debootstrap/debootstrap.log")


def _finish_template(root: Path, sources: list[AptSource]) -> None:
    """Turn a fresh debootstrap into a template every host can boot from."""
    for unit in MASKED_UNITS:
        link = root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    # Each host gets its own machine-id at first boot and its own ssh host keys.
    (root / "etc/machine-id").write_text("")
    (root / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/ssh/sshd_config.d/gemmaserve.conf").write_text(
        "# gemmaserve sandbox: root logs in with the sandbox key only.\n"
        "HostKey /etc/ssh/ssh_host_ed25519_key\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n"
    )
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
    (root / "etc/apt/sources.list.d/debian.sources").write_text("\n".join(s.deb822() for s in sources))
    # Registries may sit behind a proxy with its own CA: hosts trust what the outer machine trusts.
    if _extra_ca_certs():
        shutil.copytree(EXTRA_CA_DIR, root / "usr/local/share/ca-certificates", dirs_exist_ok=True)
        subprocess.run(["chroot", str(root), "update-ca-certificates"], check=True, capture_output=True)
    subprocess.run(["chroot", str(root), "apt-get", "clean"], check=True)
    for lists in (root / "var/lib/apt/lists").glob("*_*"):
        lists.unlink()


def unpack_rootfs(tarball: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "tar",
            "-C",
            str(target),
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "--acls",
            "-I",
            "zstd -T0",
            "-xpf",
            str(tarball),
        ],
        check=True,
    )


def outer_pip_config() -> dict[str, dict[str, str]]:
    """The outer machine's effective pip settings (`pip config list` + PIP_* env), by section."""
    config: dict[str, dict[str, str]] = {}
    for pip in ([sys.executable, "-m", "pip"], ["pip3"], ["pip"]):
        if pip[0] != sys.executable and shutil.which(pip[0]) is None:
            continue
        try:
            proc = subprocess.run([*pip, "config", "list"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode != 0:
            continue
        # Lines come in pip's load order (files, then :env:), so later lines win.
        for line in proc.stdout.splitlines():
            name, _, value = line.partition("=")
            section, _, key = name.rpartition(".")
            if not key:
                continue
            section = "global" if section == ":env:" else section
            config.setdefault(section, {})[key] = _unquote(value)
        break
    for var, value in os.environ.items():
        if var.startswith("PIP_") and var != "PIP_CONFIG_FILE":
            config.setdefault("global", {})[var[4:].lower().replace("_", "-")] = value
    return config


def _unquote(value: str) -> str:
    try:
        words = shlex.split(value)
    except ValueError:
        return value
    return words[0] if len(words) == 1 else value


# pip settings whose values may name local files or directories the host must also see.
_PATH_KEYS = ("find-links", "extra-index-url", "index-url", "constraint", "requirement", "cert", "client-cert")


def pip_local_paths(config: dict[str, dict[str, str]]) -> list[str]:
    """Local paths (file:// indexes, find-links dirs, constraint files) referenced by pip settings."""
    paths: list[str] = []
    for settings in config.values():
        for key in _PATH_KEYS:
            for item in settings.get(key, "").split():
                path = item.removeprefix("file://") if item.startswith("file://") else item
                if not path.startswith("/") or not os.path.exists(path):
                    continue
                # A file:// simple index is served from its parent too (wheel links go "../../").
                if item.startswith("file://") and Path(path).name == "simple":
                    path = str(Path(path).parent)
                if path.startswith("/etc/ssl/") or path in paths:
                    continue  # the host builds its own CA bundle
                paths.append(path)
    return paths


def render_pip_conf(config: dict[str, dict[str, str]]) -> str:
    lines = ["# Carried over from the outer machine by `gemmaserve sandbox up`."]
    for section, settings in sorted(config.items()):
        lines.append(f"[{section}]")
        lines += [f"{key} = {value}" for key, value in sorted(settings.items())]
    return "\n".join(lines) + "\n"


def customize_host(rootfs: Path, name: str, public_key: str, pip_conf: str) -> None:
    """Make an unpacked template into one host: name, ssh keys, pip settings."""
    (rootfs / "etc/hostname").write_text(f"{name}\n")
    (rootfs / "etc/hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    ssh_dir = rootfs / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(public_key.strip() + "\n")
    os.chmod(ssh_dir / "authorized_keys", 0o600)
    host_key = rootfs / "etc/ssh/ssh_host_ed25519_key"
    subprocess.run(
        ["chroot", str(rootfs), "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", "/etc/ssh/ssh_host_ed25519_key"],
        check=True,
    )
    assert host_key.exists()
    (rootfs / "etc/pip.conf").write_text(pip_conf)
