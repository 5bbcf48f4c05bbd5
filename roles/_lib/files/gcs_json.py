"""A small client for the Cloud Storage JSON API (stdlib and hostlib) for the programs hosts run: object metadata,
ranged and generation-pinned downloads, resumable uploads.

Requests and fields as documented at https://cloud.google.com/storage/docs/json_api/v1/objects (get,
insert with uploadType=resumable, `generation`, `ifGenerationMatch`, md5Hash). Credentials: the VM's
service account token from the metadata server; with STORAGE_EMULATOR_HOST set (as google-cloud-storage
reads it) requests go to that emulator without credentials.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

# Installed beside this module by the base role (roles/_lib/files/hostlib.py).
import hostlib


class StorageError(Exception):
    """A request the bucket refused; `status` is the HTTP code (0 when it could not be reached)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def _reason(status: int) -> str:
    return {
        401: "not authenticated (no service account token)",
        403: "permission denied: the host's service account needs roles/storage.objectViewer on the bucket",
        404: "not found",
        412: "precondition failed (the object changed)",
    }.get(status, f"HTTP {status}")


class Bucket:
    def __init__(self, name: str, endpoint: str | None = None):
        self.name = name
        self.endpoint = (
            endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
        ).rstrip("/")
        if "://" not in self.endpoint:
            self.endpoint = f"http://{self.endpoint}"
        self.emulated = "STORAGE_EMULATOR_HOST" in os.environ or endpoint is not None
        self._token: tuple[str, float] | None = None

    # --- plumbing -------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        if self.emulated:
            return {}
        if self._token is None or self._token[1] < time.monotonic() + 60:
            try:
                token, expires_in = hostlib.metadata_token(timeout=10)
            except (urllib.error.URLError, OSError) as error:
                raise StorageError(f"no service account token from the metadata server ({error})") from None
            self._token = (token, time.monotonic() + expires_in)
        return {"Authorization": f"Bearer {self._token[0]}"}

    def _open(self, url: str, method: str = "GET", headers: dict | None = None, data=None, timeout: float = 60):
        request = urllib.request.Request(url, method=method, data=data, headers={**self._headers(), **(headers or {})})
        opener = hostlib.NO_PROXY if self.emulated else urllib.request.build_opener()
        try:
            return opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as error:
            raise StorageError(f"gs://{self.name}: {method} {_path(url)}: {_reason(error.code)}", error.code) from None
        except (urllib.error.URLError, OSError) as error:
            raise StorageError(f"gs://{self.name}: cannot reach {self.endpoint} ({error})") from None

    def _object_url(self, name: str, upload: bool = False) -> str:
        base = f"{self.endpoint}/upload" if upload else self.endpoint
        return f"{base}/storage/v1/b/{urllib.parse.quote(self.name, safe='')}/o" + (
            "" if upload else f"/{urllib.parse.quote(name, safe='')}"
        )

    # --- API ------------------------------------------------------------------------------------
    def exists(self) -> bool:
        """Whether the bucket exists and may be read (a 403 is raised, not hidden)."""
        try:
            with self._open(f"{self.endpoint}/storage/v1/b/{urllib.parse.quote(self.name, safe='')}"):
                return True
        except StorageError as error:
            if error.status == 404:
                return False
            raise

    def stat(self, name: str) -> dict | None:
        """The object's resource (size, md5Hash, crc32c, generation, metadata), or None when absent."""
        try:
            with self._open(self._object_url(name)) as response:
                return json.loads(response.read())
        except StorageError as error:
            if error.status == 404:
                return None
            raise

    def read(self, name: str, generation: int | None = None, start: int | None = None, end: int | None = None):
        """A response streaming the object's bytes [start, end] (inclusive), pinned to `generation`."""
        query = {"alt": "media"}
        if generation is not None:
            query["generation"] = str(generation)
        headers = {"Range": f"bytes={start}-{'' if end is None else end}"} if start is not None else {}
        return self._open(f"{self._object_url(name)}?{urllib.parse.urlencode(query)}", headers=headers, timeout=120)

    def upload(
        self, name: str, path: str, metadata: dict | None = None, if_generation_match: int | None = None
    ) -> dict:
        """A resumable upload of a local file (one session, sent whole); returns the new object's resource."""
        query = {"uploadType": "resumable", "name": name}
        if if_generation_match is not None:
            query["ifGenerationMatch"] = str(if_generation_match)
        size = os.path.getsize(path)
        body = json.dumps({"name": name, "metadata": metadata or {}}).encode()
        with self._open(
            f"{self._object_url(name, upload=True)}?{urllib.parse.urlencode(query)}",
            method="POST",
            headers={"Content-Type": "application/json; charset=UTF-8", "X-Upload-Content-Length": str(size)},
            data=body,
        ) as response:
            session = response.headers["Location"]
        with open(path, "rb") as handle:
            headers = {"Content-Length": str(size), "Content-Type": "application/octet-stream"}
            with self._open(session, method="PUT", headers=headers, data=handle, timeout=600) as response:
                return json.loads(response.read())


def _path(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path)


def split_uri(uri: str) -> tuple[str, str]:
    """gs://bucket/some/prefix -> ("bucket", "some/prefix/")."""
    if not uri.startswith("gs://"):
        raise ValueError(f"{uri!r} is not a gs:// URI")
    bucket, _, prefix = uri[5:].partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""
