"""A local, signed stand-in for repo.radeon.com's ROCm 7.2.3 tree (the release the rocm role pins), so the
rocm role runs for real (not --dry) on a sandbox host. The directory tree is repo.radeon.com's
(amdgpu-install/<release>/ubuntu/<codename>/, rocm/apt/<release>, amdgpu/<version>/ubuntu,
graphics/<release>/ubuntu), for jammy, the build the role installs on Debian 12. Package names, versions and relations are the published ones where a public record of
them exists; every stanza says where its fields come from, and what is a stand-in.

What the packages contain is not AMD's: no kernel module, no libraries. `rocm-smi` prints the recorded output
of a real 4 x MI300X host (tests/roles/fixtures/recorded/mi300x_rocm_smi.txt), `amdgpu-install` is a shell
stand-in that runs the same apt-get AMD's does for the options gemmaserve uses, amdgpu-dkms builds nothing.

Sources, cited once here and by name below:
  [install-docs]  ROCm's "Ubuntu native installation" (github.com/ROCm/rocm-install-on-linux,
                  docs/install/install-methods/package-manager/package-manager-ubuntu.rst): rocm.list's line
                  and the repo.radeon.com pin at priority 600.
  [6156]          github.com/ROCm/ROCm/issues/6156: amdgpu-install writes amdgpu.list as "deb [arch=amd64,i386
                  signed-by=/etc/apt/keyrings/rocm.gpg] https://repo.radeon.com/amdgpu/<version>/ubuntu <codename>
                  main" and a graphics/<release> line into rocm.list; 30.30.1 is ROCm 7.2.1's amdgpu repository.
  [6101]          github.com/ROCm/ROCm/issues/6101: a ROCm 7.2.1 host's `apt list`: amdgpu-dkms and
                  amdgpu-dkms-firmware are Architecture all, at the same amdgpu build as amdgpu-install.
  [devcloud]      a published AMD Developer Cloud provisioning script for ROCm 7.2.3 on Ubuntu 24.04 (found by
                  code search; its repository is not named there): amdgpu-install_7.2.3.70203-1_all.deb from
                  repo.radeon.com/amdgpu-install/7.2.3/ubuntu/<codename>/, dpkg Version
                  30.30.3.0.30300300-2327507.24.04; amdgpu-dkms 1:6.16.13.30300300-2327507.24.04; rocm and
                  rocm-core 7.2.3.70203-90~24.04; the installer's files (/etc/apt/keyrings/rocm.gpg,
                  repo-radeon-pin-600, amdgpu.list, rocm.list, /usr/bin/amdgpu-install; its amdgpu-setup and
                  amdgpu-proprietary.list are not modelled here).
  [pool]          published 7.2.3 pins and pool paths: rocm-core_7.2.3.70203-90~22.04_amd64.deb and
                  rocm-llvm_22.0.0.26084.70203-90~22.04 in rocm/apt/7.2.3/pool (the jammy build), rocminfo
                  1.0.0, rocm-smi-lib 7.8.0, miopen-hip 3.5.1 at .70203-90~24.04.
  [5590]          github.com/ROCm/ROCm/issues/5590 (comment of 2025-11-02): apt's "rocm : Depends: ..." for ROCm
                  7.1.0, every dependency pinned with "(= <module version>.70100-20~24.04)".
  [aur]           AUR opencl-amd-dev 1:7.2.1-1 PKGBUILD: its sources are repo.radeon.com/rocm/apt/7.2.1 pool
                  files, naming each 7.2.1 module version (half 1.12.0, rpp 2.2.1, mivisionx 3.5.0, miopen-hip
                  3.5.1, migraphx 2.15.0, rocm-llvm 22.0.0.26084, rocm-cmake 0.14.0).
  [dpkg]          a published `dpkg-query -W` of a ROCm 7.2.1 Ubuntu 24.04 host (found by code search; its
                  repository is not named there): rocm-hip, rocm-openmp, rocm-opencl-sdk and
                  rocm-developer-tools carry the release as their version, rocminfo 1.0.0, rocm-smi-lib 7.8.0.
  [rocm-core]     github.com/ROCm/rocm-core: CMakeLists.txt writes .info/version as "<major>.<minor>.<patch>",
                  Depends "python3, libc6"; rocm-core.postinst registers /opt/rocm as an alternative.
Derived, not read anywhere: the module versions of mivisionx, rpp, migraphx, half and rocm-cmake at 7.2.3 are
7.2.1's ([aur]; 7.2.3 keeps 7.2.1's module versions wherever both are published: [pool]); the amdgpu
repository of 7.2.3 is amdgpu/30.30.3 (the installer's version, as 30.30.1 is 7.2.1's and 30.30.2 7.2.2's,
[6156]); the jammy amdgpu-* versions end in ".22.04" where noble's end in ".24.04", as every earlier
amdgpu release's do (e.g. amdgpu-dkms 1:5.18.13.50403-1538762.22.04, github.com/ROCm/legacy-rocm-build/issues/1624).
"""

from __future__ import annotations

import gzip
import hashlib
import shutil
import subprocess
from email.utils import formatdate
from pathlib import Path

from tests.roles.sandbox.cuda_repo import RECORDED, Deb, ThrowawayKey, build_deb, headers_package

MOUNT = "/srv/gemmaserve-rocm-repo"
BASE = f"file://{MOUNT}"
RELEASE = "7.2.3"
CODENAME = "jammy"
AMDGPU = "30.30.3"  # derived, see above
ROCM_BUILD = "70203-90~22.04"  # [pool]
AMDGPU_BUILD = "30300300-2327507.22.04"  # [devcloud], jammy suffix
INSTALLER_VERSION = f"{AMDGPU}.0.{AMDGPU_BUILD}"  # [devcloud]
DKMS_VERSION = f"1:6.16.13.{AMDGPU_BUILD}"  # [devcloud]
ROCM_VERSION = f"{RELEASE}.{ROCM_BUILD}"
PREFIX = f"/opt/rocm-{RELEASE}"
# The published file name of ROCm 7.2.3's installer ([devcloud]): named for the release, while its dpkg
# Version is the amdgpu one.
INSTALLER_DEB = "amdgpu-install_7.2.3.70203-1_all.deb"
# Where the distribution's own packages come from in this stand-in (the headers of the sandbox's kernel).
HEADERS_DIR = "kernel-headers"

# `rocm`'s Depends as apt printed them for 7.1.0 [5590], each at its 7.2.3 module version ([pool], [aur], [dpkg]).
ROCM_DEPENDS = {
    "rocminfo": "1.0.0",
    "rocm-cmake": "0.14.0",
    "rocm-developer-tools": RELEASE,
    "rocm-openmp": RELEASE,
    "rocm-opencl-sdk": RELEASE,
    "rocm-hip": RELEASE,
    "mivisionx": "3.5.0",
    "migraphx": "2.15.0",
    "rpp": "2.2.1",
    "rocm-core": RELEASE,
    "miopen-hip": "3.5.1",
    "half": "1.12.0",
    "rocm-llvm": "22.0.0.26084",
    "migraphx-dev": "2.15.0",
    "mivisionx-dev": "3.5.0",
    "rpp-dev": "2.2.1",
    "miopen-hip-dev": "3.5.1",
}
ROCM_SMI_LIB = "7.8.0"  # [pool]

# amdgpu-install's use cases and the meta package each installs (ROCm's meta-package table, "Legacy use case"
# column: docs/install/install-methods/includes/meta-package-table.rst); dkms adds the kernel driver.
AMDGPU_INSTALL = f"""\
#!/bin/sh
# gemmaserve sandbox stand-in for AMD's amdgpu-install ({INSTALLER_DEB}): the options gemmaserve uses, and the
# apt-get AMD's runs for them ("apt-get install -y <meta packages> amdgpu-dkms linux-headers-<kernel>" in
# its published --dryrun output). Unknown options fail, so a wrong call is caught.
set -e
yes="" dkms=1 dryrun=0 usecases=""
for arg in "$@"; do
  case "$arg" in
    -y) yes="-y" ;;
    --usecase=*) usecases="${{arg#--usecase=}}" ;;
    --no-dkms) dkms=0 ;;
    --no-32|--accept-eula) ;;
    --dryrun) dryrun=1 ;;
    *) echo "amdgpu-install (sandbox stand-in): unsupported option $arg" >&2; exit 2 ;;
  esac
done
[ -n "$usecases" ] || {{ echo "amdgpu-install (sandbox stand-in): give --usecase=" >&2; exit 2; }}
packages=""
for usecase in $(echo "$usecases" | tr , ' '); do
  case "$usecase" in
    rocm) packages="$packages rocm" ;;
    hip) packages="$packages rocm-hip-runtime" ;;
    lrt) packages="$packages rocm-language-runtime" ;;
    opencl) packages="$packages rocm-opencl-runtime" ;;
    mllib) packages="$packages rocm-ml-libraries" ;;
    hiplibsdk) packages="$packages rocm-hip-sdk" ;;
    mlsdk) packages="$packages rocm-ml-sdk" ;;
    graphics) packages="$packages amdgpu-lib" ;;
    dkms) ;;
    *) echo "amdgpu-install (sandbox stand-in): unknown use case $usecase" >&2; exit 2 ;;
  esac
done
[ "$dkms" = 0 ] || packages="$packages amdgpu-dkms linux-headers-$(uname -r)"
if [ "$dryrun" = 1 ]; then echo "apt-get install $yes$packages"; exit 0; fi
DEBIAN_FRONTEND=noninteractive exec apt-get install $yes $packages
"""

ROCM_SMI = """\
#!/bin/sh
# gemmaserve sandbox stand-in: the concise table of a real 4 x MI300X host's `rocm-smi`.
[ $# -eq 0 ] && exec cat /usr/share/gemmaserve-recorded/rocm-smi.txt
echo "rocm-smi stand-in: only the concise table (no arguments) is recorded" >&2
exit 2
"""

# rocm-core.postinst [rocm-core], without the environment-modules part: /opt/rocm follows the release.
ROCM_CORE_POSTINST = f"""\
#!/bin/sh
set -e
if [ "$1" = configure ]; then
  update-alternatives --install /opt/rocm rocm {PREFIX} 7003001
fi
"""
ROCM_CORE_PRERM = f"""\
#!/bin/sh
set -e
if [ "$1" = remove ]; then update-alternatives --remove rocm {PREFIX}; fi
"""
DKMS_POSTINST = """\
#!/bin/sh
# gemmaserve sandbox stand-in: AMD's postinst builds amdgpu with DKMS for the installed kernels; no module
# can be built or loaded in a container, so this says so and changes nothing.
echo "amdgpu-dkms (sandbox stand-in): no module built; a reboot would load AMD's amdgpu on a real host"
"""


def rocm_packages() -> list[Deb]:
    """rocm/apt/7.2.3 for jammy: `rocm` with its published Depends, the packages it names (empty, except
    rocm-core's version file and the rocm-smi that rocm-developer-tools pulls in)."""
    meta = "[5590] relations at [pool]/[aur]/[dpkg] versions; empty stand-in"
    depends = ", ".join(f"{name} (= {version}.{ROCM_BUILD})" for name, version in ROCM_DEPENDS.items())
    debs = [Deb("rocm", ROCM_VERSION, meta, depends=depends, section="devel")]
    for name, version in ROCM_DEPENDS.items():
        if name in ("rocm-core", "rocm-developer-tools"):
            continue
        debs.append(
            Deb(
                name,
                f"{version}.{ROCM_BUILD}",
                "name and version: [5590], [pool]/[aur]/[dpkg]; empty stand-in",
                depends=f"rocm-core (= {ROCM_VERSION})",
                section="devel",
            )  # fmt: skip
        )
    debs.append(
        Deb(
            "rocm-core",
            ROCM_VERSION,
            "version [devcloud], [pool]; [rocm-core]: .info/version, Depends, postinst's /opt/rocm alternative",
            depends="python3, libc6",
            section="devel",
            files={f"{PREFIX}/.info/version": f"{RELEASE}\n"},
            scripts={"postinst": ROCM_CORE_POSTINST, "prerm": ROCM_CORE_PRERM},
        )
    )
    # Stand-in relation: rocm-smi-lib is one of the tools rocm-developer-tools gathers in AMD's tree; its exact
    # Depends line for 7.2.x is not published where we could read it.
    debs.append(
        Deb(
            "rocm-developer-tools",
            ROCM_VERSION,
            "[5590], [dpkg]; Depends: stand-in subset",
            depends=f"rocm-core (= {ROCM_VERSION}), rocm-smi-lib (= {ROCM_SMI_LIB}.{ROCM_BUILD})",
            section="devel",
        )  # fmt: skip
    )
    debs.append(
        Deb(
            "rocm-smi-lib",
            f"{ROCM_SMI_LIB}.{ROCM_BUILD}",
            "name and version: [pool]; rocm-smi prints a recorded MI300X table",
            depends=f"rocm-core (= {ROCM_VERSION})",
            section="devel",
            files={
                f"{PREFIX}/bin/rocm-smi": ROCM_SMI,
                "/usr/share/gemmaserve-recorded/rocm-smi.txt": (RECORDED / "mi300x_rocm_smi.txt").read_text(),
            },
            executables=(f"{PREFIX}/bin/rocm-smi",),
        )
    )
    return debs


def amdgpu_packages() -> list[Deb]:
    """amdgpu/30.30.3 for jammy: the DKMS driver and its firmware, Architecture all ([6101], [devcloud])."""
    firmware = f"{AMDGPU}.0.{AMDGPU_BUILD}"
    return [
        Deb(
            "amdgpu-dkms",
            DKMS_VERSION,
            "[devcloud], [6101]; Depends on its firmware as ROCm/ROCm#5590 describes; builds nothing",
            arch="all",
            depends=f"amdgpu-dkms-firmware (= {firmware})",
            section="misc",
            scripts={"postinst": DKMS_POSTINST},
        ),
        Deb("amdgpu-dkms-firmware", firmware, "[6101], version derived; empty stand-in", arch="all", section="misc"),
    ]


def installer_package(keyring: bytes) -> Deb:
    """amdgpu-install as AMD ships it: the repository lists, the signing key and the pin as conffiles
    ([6156], [install-docs], [devcloud]), and /usr/bin/amdgpu-install; pointed at this repository instead of
    AMD's."""
    signed = "signed-by=/etc/apt/keyrings/rocm.gpg"
    files = {
        "/etc/apt/sources.list.d/rocm.list": (
            f"deb [arch=amd64 {signed}] {BASE}/rocm/apt/{RELEASE} {CODENAME} main\n"
            f"deb [arch=amd64 {signed}] {BASE}/graphics/{RELEASE}/ubuntu {CODENAME} main\n"
        ),
        "/etc/apt/sources.list.d/amdgpu.list": f"deb [arch=amd64,i386 {signed}] {BASE}/amdgpu/{AMDGPU}/ubuntu {CODENAME} main\n",
        "/etc/apt/preferences.d/repo-radeon-pin-600": "Package: *\nPin: release o=repo.radeon.com\nPin-Priority: 600\n",
        "/etc/apt/keyrings/rocm.gpg": keyring,
        "/usr/bin/amdgpu-install": AMDGPU_INSTALL,
    }
    return Deb(
        "amdgpu-install",
        INSTALLER_VERSION,
        "version [devcloud]; files [6156], [install-docs], [devcloud]; the installer script is a stand-in",
        arch="all",
        section="misc",
        files=files,
        executables=("/usr/bin/amdgpu-install",),
        conffiles=tuple(path for path in files if path.startswith("/etc/")),
    )


def index(repo: Path, pool: str, origin: str, suite: str | None) -> Path:
    """Packages(.gz) and a Release for the .debs under repo/pool: a dists/<suite>/main tree, or flat."""
    packages = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", pool], cwd=repo, check=True, capture_output=True
    ).stdout
    where = repo / "dists" / suite / "main" / "binary-amd64" if suite else repo
    where.mkdir(parents=True, exist_ok=True)
    (where / "Packages").write_bytes(packages)
    (where / "Packages.gz").write_bytes(gzip.compress(packages))
    top = repo / "dists" / suite if suite else repo
    release = [f"Origin: {origin}", "Label: gemmaserve sandbox stand-in", f"Date: {formatdate(usegmt=True)}"]
    if suite:
        release += [f"Suite: {suite}", f"Codename: {suite}", "Components: main"]
    release += ["Architectures: amd64", "SHA256:"]
    for file in (where / "Packages", where / "Packages.gz"):
        data = file.read_bytes()
        release.append(f" {hashlib.sha256(data).hexdigest()} {len(data)} {file.relative_to(top)}")
    (top / "Release").write_text("\n".join(release) + "\n")
    return top


def build_repo(out: Path, kernel: str) -> Path:
    """repo.radeon.com's tree for ROCm 7.2.3/jammy in `out`, every index signed (InRelease) with a throwaway
    key, plus a flat `kernel-headers` repository standing in for the distribution's (same key)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    key = ThrowawayKey(out, "gemmaserve sandbox repo.radeon.com stand-in")
    keyring = key.keyring
    (out / "keyring.gpg").write_bytes(keyring)

    installer_dir = out / "amdgpu-install" / RELEASE / "ubuntu" / CODENAME
    installer_dir.mkdir(parents=True)
    built = build_deb(installer_package(keyring), installer_dir)
    built.rename(installer_dir / INSTALLER_DEB)

    repos = {
        out / "rocm" / "apt" / RELEASE: rocm_packages(),
        out / "amdgpu" / AMDGPU / "ubuntu": amdgpu_packages(),
        # The graphics repository (Mesa and the like) is registered by amdgpu-install; the rocm use case
        # needs nothing from it, so it is empty here.
        out / "graphics" / RELEASE / "ubuntu": [],
    }
    tops = []
    for repo, debs in repos.items():
        pool = repo / "pool" / "main"
        pool.mkdir(parents=True)
        for deb in debs:
            built = build_deb(deb, pool)
            # Pool file names carry no epoch (amdgpu-dkms 1:6.16.13... -> amdgpu-dkms_6.16.13..._all.deb).
            built.rename(built.with_name(built.name.replace(f"_{deb.version}_", f"_{deb.version.split(':')[-1]}_")))
        tops.append(index(repo, "pool", "repo.radeon.com", CODENAME))
    headers = out / HEADERS_DIR
    headers.mkdir()
    build_deb(headers_package(kernel), headers)
    tops.append(index(headers, ".", "gemmaserve sandbox", None))
    for top in tops:
        key.clearsign(top)
    key.remove()
    return out
