"""`gemmaserve weights mirror`: copy one pinned model revision from Hugging Face (or a local directory that
serves the same metadata) into the stack's bucket, once: resumable per file, every byte checked against the
source's own hashes, idempotent (a second run copies nothing). Hosts then load from the bucket alone. The spec's
LoRA adapters go beside it the same way (`mirror_adapters`), each at its pinned revision.

The source side is a small seam (`ModelSource`): `HubSource` asks huggingface_hub for the file list with
hashes (`HfApi.model_info(files_metadata=True)`: size, git blob id, LFS sha256) and downloads with
`hf_hub_download`; `LocalSource` serves a directory's files in the same shape (used for test models and
in tests, where the hub is unreachable).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from gemmaserve.plan import AdapterWeights, WeightsPlan

# Files a serving host never needs (the hub's README images, original/ checkpoints in other formats).
SKIP_PATTERNS = (".gitattributes", "original/", ".git/")
# What vLLM loads an adapter from: adapter_config.json and the first of these weights files it finds
# (LoRAModel.from_local_checkpoint, vllm/lora/lora_model.py at v0.32.0).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
CHUNK = 8 * 2**20
Progress = Callable[[str], None]


class MirrorError(Exception):
    """A mirror that cannot be made (missing bucket, refused write, a hash that does not match)."""


@dataclass(frozen=True)
class SourceFile:
    """One file of a revision with the hashes the source vouches for: the LFS sha256 (large files) and the
    git blob sha1 (every file), as the hub reports them."""

    path: str
    size: int
    git_sha1: str
    sha256: str | None = None


class ModelSource(Protocol):
    def resolve(self, revision: str | None) -> str:
        """The commit sha a revision (branch, tag or sha) points to."""

    def files(self, revision: str) -> list[SourceFile]: ...

    def fetch(self, revision: str, path: str, workdir: Path) -> Path:
        """A local file holding `path` at `revision` (downloaded into `workdir` when needed)."""


def git_blob_sha1(path: Path) -> str:
    """git's object id of a file: sha1 over "blob <size>\\0" and the bytes (what the hub reports as blob_id)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(path: Path) -> tuple[str, str, str]:
    """(sha256 hex, git blob sha1 hex, md5 base64) of a file, in one read."""
    import base64

    sha256, md5 = hashlib.sha256(), hashlib.md5()
    blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            sha256.update(chunk)
            md5.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest(), base64.b64encode(md5.digest()).decode()


def _skipped(path: str) -> bool:
    return any(path == p or path.startswith(p) for p in SKIP_PATTERNS)


class HubSource:
    """A model repository on Hugging Face, through huggingface_hub (the token from HF_TOKEN or its login)."""

    def __init__(self, repo_id: str, token: str | None = None):
        from huggingface_hub import HfApi

        self.repo_id, self.token, self.api = repo_id, token, HfApi(token=token)

    def resolve(self, revision: str | None) -> str:
        return self.api.model_info(self.repo_id, revision=revision).sha

    def files(self, revision: str) -> list[SourceFile]:
        info = self.api.model_info(self.repo_id, revision=revision, files_metadata=True)
        return [
            SourceFile(s.rfilename, s.size, s.blob_id, s.lfs.sha256 if s.lfs else None)
            for s in info.siblings
            if not _skipped(s.rfilename)
        ]

    def fetch(self, revision: str, path: str, workdir: Path) -> Path:
        from huggingface_hub import hf_hub_download

        # The hub client resumes its own interrupted downloads (.incomplete files in workdir).
        return Path(hf_hub_download(self.repo_id, path, revision=revision, local_dir=workdir, token=self.token))


class LocalSource:
    """A directory served in the hub's shape: every file with its size, git blob sha1, and sha256 for the
    files the hub keeps in LFS (safetensors and other large files). The revision is a tree hash over them."""

    LFS_MIN_BYTES = 10 * 2**20

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise MirrorError(f"source directory {self.directory} does not exist")
        self._files: list[SourceFile] | None = None

    def _scan(self) -> list[SourceFile]:
        if self._files is None:
            found = []
            for path in sorted(p for p in self.directory.rglob("*") if p.is_file()):
                name = path.relative_to(self.directory).as_posix()
                if _skipped(name) or name.startswith("."):
                    continue
                sha256, blob, _ = file_hashes(path)
                lfs = path.suffix == ".safetensors" or path.stat().st_size >= self.LFS_MIN_BYTES
                found.append(SourceFile(name, path.stat().st_size, blob, sha256 if lfs else None))
            self._files = found
        return self._files

    def resolve(self, revision: str | None) -> str:
        tree = "".join(f"{f.path} {f.git_sha1}\n" for f in self._scan())
        sha = hashlib.sha1(tree.encode()).hexdigest()
        if revision not in (None, sha):
            raise MirrorError(f"revision {revision} is not {self.directory}'s content (its revision is {sha})")
        return sha

    def files(self, revision: str) -> list[SourceFile]:
        self.resolve(revision)
        return list(self._scan())

    def fetch(self, revision: str, path: str, workdir: Path) -> Path:
        return self.directory / path


@dataclass
class MirrorReport:
    uri: str
    revision: str
    copied: list[str]
    skipped: list[str]
    bytes_copied: int
    seconds: float
    manifest_written: bool

    @property
    def mib_per_s(self) -> float:
        return self.bytes_copied / 2**20 / self.seconds if self.seconds else 0.0


def storage_client(project: str | None = None):
    """google-cloud-storage's client; STORAGE_EMULATOR_HOST points it at an emulator (anonymous there)."""
    from google.cloud import storage

    return storage.Client(project=project)


def mirror(
    weights: WeightsPlan,
    source: ModelSource,
    client=None,
    progress: Progress = print,
    workdir: Path | None = None,
) -> MirrorReport:
    """Copy weights.revision of weights.model_id into gs://bucket/prefix/models/<id>/<revision>/, then the
    manifest. Objects already there with the same hashes are kept; every copied file is checked against the
    source's hash before upload and against GCS's md5 after."""
    if not weights.from_bucket or not weights.revision:
        raise MirrorError("the spec names no weights.bucket and weights.revision to mirror to")
    bucket = _bucket(weights.bucket, client or storage_client())
    return _mirror_revision(
        bucket,
        weights.model_id,
        weights.revision,
        weights.object_prefix,
        weights.manifest_object,
        {"model": weights.model_id},
        source,
        _missing_model_files,
        progress,
        workdir,
    )


def mirror_assistant(
    weights: WeightsPlan,
    source: ModelSource | None = None,
    client=None,
    progress: Progress = print,
    workdir: Path | None = None,
) -> MirrorReport | None:
    """Copy the MTP assistant (weights.assistant) at its pinned commit into gs://bucket/prefix/models/<id>/<revision>/
    with its own manifest, as `mirror` copies the model; None when the plan has none. `source` replaces the hub
    (tests)."""
    assistant = weights.assistant
    if assistant is None:
        return None
    bucket = _bucket(weights.bucket, client or storage_client())
    return _mirror_revision(
        bucket,
        f"MTP assistant {assistant.model_id}",
        assistant.revision,
        assistant.object_prefix,
        assistant.manifest_object,
        {"model": assistant.model_id, "assistant_of": weights.model_id},
        source or HubSource(assistant.model_id),
        _missing_model_files,
        progress,
        workdir,
    )


def adapter_source(adapter: AdapterWeights, token: str | None = None) -> ModelSource:
    """Where the mirror reads an adapter: its directory, or its hub repository."""
    return LocalSource(adapter.source) if adapter.source.startswith("/") else HubSource(adapter.source, token)


def mirror_adapters(
    weights: WeightsPlan,
    sources: dict[str, ModelSource] | None = None,
    client=None,
    progress: Progress = print,
    workdir: Path | None = None,
) -> list[MirrorReport]:
    """Copy each of the spec's LoRA adapters (weights.adapters) into gs://bucket/prefix/adapters/<id>/<revision>/
    with its own manifest, exactly as `mirror` copies the model: a hub adapter at its commit, a directory at its
    content revision. `sources` (by adapter name) replaces where one is read from (tests)."""
    if not weights.adapters:
        return []
    if not weights.from_bucket:
        raise MirrorError("the spec names no weights.bucket to mirror the adapters to")
    bucket = _bucket(weights.bucket, client or storage_client())
    reports = []
    for adapter in weights.adapters:
        source = (sources or {}).get(adapter.name) or adapter_source(adapter)
        reports.append(
            _mirror_revision(
                bucket,
                f"adapter {adapter.name} ({adapter.source})",
                adapter.revision,
                adapter.object_prefix,
                adapter.manifest_object,
                {"adapter": adapter.name, "source": adapter.source},
                source,
                _missing_adapter_files,
                progress,
                workdir,
            )
        )
    return reports


def _missing_model_files(names: set[str]) -> str | None:
    return None if any(n.endswith(".safetensors") for n in names) else "safetensors weights to mirror"


def _missing_adapter_files(names: set[str]) -> str | None:
    missing = [] if ADAPTER_CONFIG in names else [ADAPTER_CONFIG]
    if not names & set(ADAPTER_WEIGHTS):
        missing.append(" or ".join(ADAPTER_WEIGHTS))
    return f"{' and '.join(missing)}: not a LoRA adapter vLLM loads" if missing else None


def _bucket(name: str, client):
    from google.api_core import exceptions

    try:
        return client.get_bucket(name)
    except exceptions.NotFound:
        raise MirrorError(
            f"weights.bucket = gs://{name}: no such bucket (create it with `pulumi up`; the stack exports "
            "weights_bucket)"
        ) from None
    except exceptions.Forbidden as error:
        raise MirrorError(f"gs://{name}: access refused ({error.message})") from None


def _mirror_revision(
    bucket,
    label: str,
    pinned: str,
    object_prefix: str,
    manifest_object: str,
    identity: dict,
    source: ModelSource,
    missing: Callable[[set[str]], str | None],
    progress: Progress,
    workdir: Path | None,
) -> MirrorReport:
    """One revision's files into object_prefix, then its manifest (identity, the revision, every file's hashes and
    generation): what weights_pull.py on the hosts reads."""
    from google.api_core import exceptions

    started = time.monotonic()
    revision = source.resolve(pinned)
    if revision != pinned:
        raise MirrorError(f"{label}: revision {pinned!r} is not the source's; the source's revision is {revision}")
    files = source.files(revision)
    if problem := missing({f.path for f in files}):
        raise MirrorError(f"{label}@{revision} has no {problem}")
    progress(f"mirroring {label}@{revision[:12]}: {len(files)} files, {_gib(sum(f.size for f in files))}")
    copied, skipped, copied_bytes = [], [], 0
    entries = []
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        for item in files:
            name = f"{object_prefix}{item.path}"
            existing = bucket.get_blob(name)
            if existing is not None and _same(existing, item):
                skipped.append(item.path)
                entries.append(_entry(item, existing))
                progress(f"  {item.path}: already mirrored ({_gib(item.size)})")
                continue
            local = source.fetch(revision, item.path, Path(scratch))
            sha256, blob_sha1, md5 = file_hashes(local)
            if (
                blob_sha1 != item.git_sha1
                or (item.sha256 and sha256 != item.sha256)
                or local.stat().st_size != item.size
            ):
                raise MirrorError(
                    f"{item.path}: the downloaded bytes do not match the source's hashes "
                    f"(sha256 {sha256[:16]}…, expected {str(item.sha256)[:16]}…); nothing was uploaded for it"
                )
            # google-cloud-storage sends files over 8 MiB as one resumable upload session (its default
            # chunking); 32 MiB chunks ran at half the speed against the emulator.
            blob = bucket.blob(name)
            blob.metadata = {"gemmaserve-sha256": sha256, "gemmaserve-git-sha1": blob_sha1}
            began = time.monotonic()
            try:
                # if_generation_match: never overwrite an object someone else changed meanwhile (0 = must not exist).
                blob.upload_from_filename(
                    str(local),
                    checksum="md5",
                    if_generation_match=existing.generation if existing is not None else 0,
                )
            except exceptions.Forbidden as error:
                raise MirrorError(f"gs://{bucket.name}/{name}: upload refused ({error.message})") from None
            except exceptions.PreconditionFailed:
                raise MirrorError(f"gs://{bucket.name}/{name} changed while mirroring; run the mirror again") from None
            if blob.md5_hash != md5:
                raise MirrorError(f"gs://{bucket.name}/{name}: stored md5 {blob.md5_hash} is not the file's {md5}")
            took = time.monotonic() - began
            copied.append(item.path)
            copied_bytes += item.size
            entries.append(_entry(item, blob))
            progress(
                f"  {item.path}: copied {_gib(item.size)} in {took:.1f} s ({item.size / 2**20 / max(took, 1e-6):.0f} MiB/s)"
            )
            if local.parent == Path(scratch) or Path(scratch) in local.parents:
                local.unlink(missing_ok=True)
    manifest = {**identity, "revision": revision, "files": entries}
    written = _write_manifest(bucket, manifest_object, manifest)
    report = MirrorReport(
        f"gs://{bucket.name}/{object_prefix}",
        revision,
        copied,
        skipped,
        copied_bytes,
        time.monotonic() - started,
        written,
    )
    progress(
        f"mirrored to {report.uri}: {len(copied)} copied ({_gib(copied_bytes)}), {len(skipped)} already there, "
        f"manifest {'written' if written else 'unchanged'}, {report.seconds:.1f} s"
    )
    return report


def _same(blob, item: SourceFile) -> bool:
    meta = blob.metadata or {}
    return (
        blob.size == item.size
        and meta.get("gemmaserve-git-sha1") == item.git_sha1
        and (item.sha256 is None or meta.get("gemmaserve-sha256") == item.sha256)
    )


def _entry(item: SourceFile, blob) -> dict:
    meta = blob.metadata or {}
    return {
        "path": item.path,
        "size": item.size,
        "sha256": meta.get("gemmaserve-sha256", item.sha256),
        "git_sha1": item.git_sha1,
        "md5": blob.md5_hash,
        "generation": int(blob.generation),
    }


def _write_manifest(bucket, manifest_object: str, manifest: dict) -> bool:
    """The manifest goes last: a revision without one is incomplete, and hosts refuse it."""
    blob = bucket.get_blob(manifest_object)
    body = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    if blob is not None and blob.download_as_text() == body:
        return False
    target = bucket.blob(manifest_object)
    target.upload_from_string(
        body, content_type="application/json", if_generation_match=blob.generation if blob is not None else 0
    )
    return True


def read_manifest(weights: WeightsPlan, client=None, adapter: AdapterWeights | None = None) -> dict | None:
    """The model's manifest in the mirror, or an adapter's; None when it is not there."""
    client = client or storage_client()
    blob = client.bucket(weights.bucket).get_blob((adapter or weights).manifest_object)
    return json.loads(blob.download_as_bytes()) if blob is not None else None


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def manifest_files(manifest: dict) -> Iterable[SourceFile]:
    return (SourceFile(f["path"], f["size"], f["git_sha1"], f.get("sha256")) for f in manifest["files"])


def report_json(report: MirrorReport) -> str:
    return json.dumps(asdict(report), indent=2)
