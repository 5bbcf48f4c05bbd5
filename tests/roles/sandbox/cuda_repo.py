"""A local, signed apt repository standing in for NVIDIA's CUDA repository for Debian 12, so the nvidia role
runs for real (not --dry) on a sandbox host. Package names, versions and relations are the published ones
where a public record of them exists; every stanza says where its fields come from, and what is a stand-in.

What the packages contain is not NVIDIA's: no kernel module, no libraries. `nvidia-smi` prints recorded
outputs of a real 8 x H100 host (tests/roles/fixtures/recorded), `nvidia-persistenced` carries Debian's
real unit with a stub daemon, `nvidia-modprobe` exits 0 (a container cannot load modules).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
MOUNT = "/srv/gemmaserve-cuda-repo"
# The branch gemmaserve pins and a newer one the repository also offers, so the pin is what holds it.
# 580.126.20: the 580 driver Azure's HPC images pin for HGX H100 (github.com/Azure/azhpc-images versions.json)
# and a listed 580 patch of NVIDIA's repository; 595.45.04-1: the Debian CUDA-repository version a real
# Debian host shows for nvidia-open, nvidia-driver-cuda and nvidia-kernel-open-dkms (a published `dpkg -l`).
DRIVER = "580.126.20-1"
NEWER = "595.45.04-1"

# Debian 12's nvidia-persistenced unit as Debian ships it (nvidia-persistenced_550.163.01-1_amd64.deb,
# /lib/systemd/system/nvidia-persistenced.service), license header omitted.
PERSISTENCED_UNIT = """\
[Unit]
Description=NVIDIA Persistence Daemon
Wants=syslog.target

[Service]
Type=forking
ExecStart=/usr/bin/nvidia-persistenced --user nvpd
ExecStopPost=/bin/rm -rf /var/run/nvidia-persistenced

[Install]
WantedBy=multi-user.target
"""
# Stand-in: the fabric manager tarball's unit is not reachable from here; this one only names the daemon.
FABRICMANAGER_UNIT = """\
[Unit]
Description=NVIDIA fabric manager service (gemmaserve sandbox stand-in)

[Service]
Type=forking
ExecStart=/usr/bin/nv-fabricmanager

[Install]
WantedBy=multi-user.target
"""
FORKING_STUB = (
    "#!/bin/sh\n# gemmaserve sandbox stand-in: a daemon that does nothing.\n( exec sleep infinity ) &\nexit 0\n"
)
NVIDIA_SMI_STUB = """\
#!/bin/sh
# gemmaserve sandbox stand-in: recorded outputs of a real 8 x H100 HGX host.
case "$*" in
  "-q"|"-q "*) exec cat /usr/share/gemmaserve-recorded/nvidia-smi-q.txt ;;
  "topo -m") exec cat /usr/share/gemmaserve-recorded/topo-m.txt ;;
esac
echo "nvidia-smi stand-in: only -q and topo -m are recorded" >&2
exit 2
"""


@dataclass(frozen=True)
class Deb:
    name: str
    version: str
    source: str
    arch: str = "amd64"
    depends: str = ""
    provides: str = ""
    conflicts: str = ""
    files: dict[str, str] = field(default_factory=dict)
    executables: tuple[str, ...] = ()
    section: str = "NVIDIA"
    # Maintainer scripts (postinst, prerm, ...) by name, and the files dpkg keeps as conffiles.
    scripts: dict[str, str] = field(default_factory=dict)
    conffiles: tuple[str, ...] = ()


def driver_packages(version: str) -> list[Deb]:
    """NVIDIA's Debian driver packages at one version. Names: the Debian CUDA repository's, as a real host
    lists them (nvidia-open, nvidia-driver, nvidia-driver-cuda, nvidia-kernel-open-dkms) and as pinning
    guides name them (libcuda1, nvidia-smi, firmware-nvidia-gsp). Relations: cuda-drivers-580's published
    Depends (forums.developer.nvidia.com/t/353805: nvidia-driver, nvidia-driver-cuda, nvidia-kernel-dkms
    ... (>= 580.65.06)) is the model for nvidia-open's with the open kernel flavour; the leaf relations
    below are NOT from NVIDIA's index (not reachable here), only enough to pull the stand-ins in."""
    upstream = version.split("-")[0]
    # 580.65.06: the floor cuda-drivers-580's published Depends names; the branch's first release otherwise.
    floor = "580.65.06" if upstream.startswith("580.") else upstream
    meta = "Debian CUDA repository names; relations modelled on cuda-drivers-580's published Depends"
    return [
        Deb(
            "nvidia-open",
            version,
            meta,
            depends=f"nvidia-driver (>= {floor}), nvidia-driver-cuda (>= {floor}), nvidia-kernel-open-dkms (>= {floor})",
        ),
        Deb("nvidia-driver", version, meta, depends=f"nvidia-smi (= {version})"),
        Deb(
            "nvidia-driver-cuda",
            version,
            meta,
            depends=f"libcuda1 (= {version}), nvidia-persistenced (>= {floor}), nvidia-modprobe (>= {floor})",
        ),
        Deb("nvidia-kernel-open-dkms", version, meta, depends=f"dkms, firmware-nvidia-gsp (= {version})"),
        Deb("firmware-nvidia-gsp", version, "name from Debian-family driver listings; empty stand-in"),
        Deb("libcuda1", version, "name from Debian-family driver listings; empty stand-in"),
        Deb(
            "nvidia-smi",
            version,
            "name from Debian-family driver listings; prints recorded outputs",
            files={
                "/usr/bin/nvidia-smi": NVIDIA_SMI_STUB,
                "/usr/share/gemmaserve-recorded/nvidia-smi-q.txt": (RECORDED / "h100_hgx_nvidia_smi_q.txt").read_text(),
                "/usr/share/gemmaserve-recorded/topo-m.txt": (RECORDED / "h100_hgx_topo_m.txt").read_text(),
            },
            executables=("/usr/bin/nvidia-smi",),
        ),
        Deb(
            "nvidia-persistenced",
            version,
            "Debian 12's real unit; stub daemon",
            files={
                "/lib/systemd/system/nvidia-persistenced.service": PERSISTENCED_UNIT,
                "/usr/bin/nvidia-persistenced": FORKING_STUB,
            },
            executables=("/usr/bin/nvidia-persistenced",),
        ),
        Deb(
            "nvidia-modprobe",
            version,
            "stub: exits 0 (no module to load in a container)",
            files={"/usr/bin/nvidia-modprobe": "#!/bin/sh\nexit 0\n"},
            executables=("/usr/bin/nvidia-modprobe",),
        ),
        # From branch 580 the fabric manager package carries no branch in its name (Azure's HPC image scripts).
        Deb(
            "nvidia-fabricmanager",
            version,
            "name and per-driver-version versioning: github.com/Azure/azhpc-images install_nvidia_fabric_manager.sh",
            files={
                "/lib/systemd/system/nvidia-fabricmanager.service": FABRICMANAGER_UNIT,
                "/usr/bin/nv-fabricmanager": FORKING_STUB,
            },
            executables=("/usr/bin/nv-fabricmanager",),
        ),
    ]


def pinning_package(branch: int, version: str) -> Deb:
    """nvidia-driver-pinning-<branch>: Provides/Conflicts/Replaces nvidia-driver-pinning and ships an apt
    preferences file at priority 1000 (an `apt-cache show` of NVIDIA's Ubuntu 24.04 repository, published).
    The preferences file's exact text is NOT published where we could read it: this one holds the driver
    packages above to the branch the same way."""
    text = (
        f"# nvidia-driver-pinning-{branch} (gemmaserve sandbox stand-in for the file's content)\n"
        "Package: nvidia-* libcuda1 firmware-nvidia-* libnvidia-* cuda-drivers*\n"
        f"Pin: version {branch}.*\n"
        "Pin-Priority: 1000\n"
    )
    return Deb(
        f"nvidia-driver-pinning-{branch}",
        version,
        "Provides/Conflicts: published apt-cache show; file content: stand-in",
        arch="all",
        provides="nvidia-driver-pinning",
        conflicts="nvidia-driver-pinning",
        files={f"/etc/apt/preferences.d/nvidia-driver-pinning-{branch}": text},
    )


def keyring_package(keyring: bytes) -> Deb:
    """cuda-keyring 1.1-1 as NVIDIA/apt-packaging-cuda-keyring builds it (the keyring in /usr/share/keyrings
    and cuda-<distro>-<arch>.list with signed-by), for this repository's key and path instead of NVIDIA's."""
    return Deb(
        "cuda-keyring",
        "1.1-1",
        "NVIDIA/apt-packaging-cuda-keyring templates (control.in, cuda-REPO.list.in, install.in)",
        arch="all",
        files={
            "/usr/share/keyrings/cuda-archive-keyring.gpg": keyring,
            "/etc/apt/sources.list.d/cuda-debian12-x86_64.list": (
                f"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] file:{MOUNT}/ /\n"
            ),
        },
    )


def headers_package(kernel: str) -> Deb:
    """The running kernel's headers: a stand-in for the distribution's linux-headers-$(uname -r), which Debian
    does not publish for the machine's own kernel (sandbox hosts share the outer machine's kernel)."""
    return Deb(f"linux-headers-{kernel}", "1", "stand-in for the distribution's headers of the sandbox kernel")


def build_deb(deb: Deb, out: Path) -> Path:
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        (root / "DEBIAN").mkdir()
        control = [
            f"Package: {deb.name}",
            f"Version: {deb.version}",
            f"Architecture: {deb.arch}",
            "Maintainer: gemmaserve sandbox <sandbox@gemmaserve.invalid>",
            f"Section: {deb.section}",
            "Priority: optional",
        ]
        for key, value in (("Depends", deb.depends), ("Provides", deb.provides), ("Conflicts", deb.conflicts)):
            if value:
                control.append(f"{key}: {value}")
        if deb.conflicts:
            control.append(f"Replaces: {deb.conflicts}")
        control.append(f"Description: {deb.name} (gemmaserve sandbox stand-in)\n Fields from: {deb.source}")
        (root / "DEBIAN" / "control").write_text("\n".join(control) + "\n")
        for script, text in deb.scripts.items():
            (root / "DEBIAN" / script).write_text(text)
            (root / "DEBIAN" / script).chmod(0o755)
        if deb.conffiles:
            (root / "DEBIAN" / "conffiles").write_text("".join(f"{path}\n" for path in deb.conffiles))
        for path, content in deb.files.items():
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content if isinstance(content, bytes) else content.encode())
            target.chmod(0o755 if path in deb.executables else 0o644)
        name = out / f"{deb.name}_{deb.version}_{deb.arch}.deb"
        subprocess.run(
            ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(name)],
            check=True,
            capture_output=True,
        )
    return name


class ThrowawayKey:
    """An ed25519 signing key made for one repository build, in a GNUPGHOME beside `out`; `keyring` is its
    public key (what apt's signed-by names), `clearsign` signs a directory's Release as InRelease."""

    GPG = ("gpg", "--batch", "--quiet", "--pinentry-mode", "loopback", "--passphrase", "")

    def __init__(self, out: Path, uid: str) -> None:
        self.home = out.parent / f"{out.name}.gnupg"
        shutil.rmtree(self.home, ignore_errors=True)
        self.home.mkdir(mode=0o700)
        self.env = {**os.environ, "GNUPGHOME": str(self.home)}
        subprocess.run([*self.GPG, "--quick-gen-key", uid, "ed25519", "sign", "1d"], env=self.env, check=True)
        self.keyring = subprocess.run([*self.GPG, "--export"], env=self.env, check=True, capture_output=True).stdout

    def clearsign(self, directory: Path) -> None:
        release, signed = directory / "Release", directory / "InRelease"
        subprocess.run(
            [*self.GPG, "--yes", "--clearsign", "--output", str(signed), str(release)], env=self.env, check=True
        )

    def remove(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


def build_repo(out: Path, kernel: str) -> Path:
    """Packages, Packages.gz and a Release signed with a throwaway key (InRelease), in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    key = ThrowawayKey(out, "gemmaserve sandbox CUDA repository")
    debs = [
        keyring_package(key.keyring),
        pinning_package(580, DRIVER),
        pinning_package(595, NEWER),
        headers_package(kernel),
    ]
    debs += driver_packages(DRIVER) + driver_packages(NEWER)
    for deb in debs:
        build_deb(deb, out)
    packages = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."], cwd=out, check=True, capture_output=True
    ).stdout
    (out / "Packages").write_bytes(packages)
    (out / "Packages.gz").write_bytes(gzip.compress(packages))
    release = [
        "Origin: gemmaserve sandbox",
        "Label: CUDA repository stand-in",
        f"Date: {formatdate(usegmt=True)}",
        "Architectures: amd64 all",
        "SHA256:",
    ]
    for index in ("Packages", "Packages.gz"):
        data = (out / index).read_bytes()
        release.append(f" {hashlib.sha256(data).hexdigest()} {len(data)} {index}")
    (out / "Release").write_text("\n".join(release) + "\n")
    key.clearsign(out)
    key.remove()
    return out
