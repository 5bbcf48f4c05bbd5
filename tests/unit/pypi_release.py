"""A release's sdist from PyPI, verified against the index's sha256 and cached outside the repository."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import urllib.request
from pathlib import Path

CACHE = Path(os.environ.get("GEMMASERVE_SOURCE_CACHE", Path.home() / ".cache" / "gemmaserve" / "sources"))
SIMPLE = "https://pypi.org/simple/{project}/"


def sdist(project: str, version: str) -> Path:
    """Unpacked `<project>-<version>` sdist directory (downloaded once, checked against PyPI's sha256)."""
    name = f"{project.replace('-', '_')}-{version}"
    target = CACHE / name
    if (target / ".complete").exists():
        return target / "src" / os.listdir(target / "src")[0]
    request = urllib.request.Request(
        SIMPLE.format(project=project), headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    wanted = {f"{project}-{version}.tar.gz", f"{name}.tar.gz"}
    entry = next(f for f in files if f["filename"] in wanted)
    archive = CACHE / entry["filename"]
    CACHE.mkdir(parents=True, exist_ok=True)
    if not archive.exists() or hashlib.sha256(archive.read_bytes()).hexdigest() != entry["hashes"]["sha256"]:
        partial = archive.with_suffix(".partial")
        with urllib.request.urlopen(entry["url"], timeout=600) as response, partial.open("wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        if hashlib.sha256(partial.read_bytes()).hexdigest() != entry["hashes"]["sha256"]:
            partial.unlink()
            raise RuntimeError(f"{entry['filename']}: sha256 differs from PyPI's")
        partial.rename(archive)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/requirements/" in m.name or "/examples/" in m.name]
        tar.extractall(target / "src", members=members, filter="data")
    (target / ".complete").touch()
    return target / "src" / os.listdir(target / "src")[0]
