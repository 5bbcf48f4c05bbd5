"""What the TPU provider needs from tpu.googleapis.com v2alpha1 (and compute v1 disks), and the adapter over REST.

The adapter is google-api-python-client's discovery client built from the discovery document shipped in
its wheel (static_discovery): methods, paths and parameters are Google's own, and the bodies are the
REST JSON the tests check against that same document. The proto-based google-cloud-tpu client cannot
carry flex-start (provisioningModel, runDuration), which the discovery document has.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Protocol


class ApiError(Exception):
    """An API call refused: HTTP code, canonical status (RESOURCE_EXHAUSTED, NOT_FOUND, ...), message and details.

    details: the google.rpc.Status details (ErrorInfo, QuotaFailure, ... each with its "@type"), which say
    what RESOURCE_EXHAUSTED means: a quota or no capacity (https://cloud.google.com/apis/design/errors,
    github.com/googleapis/googleapis google/rpc/error_details.proto).
    """

    def __init__(self, code: int, status: str, message: str, details: list[dict] | tuple = ()):
        self.code, self.status, self.message, self.details = code, status, message, list(details or [])
        super().__init__(f"{status} ({code}): {message}")


class TpuApi(Protocol):
    """The calls the provider makes, in REST JSON; long-running operations are waited for by the adapter."""

    def create_queued_resource(self, parent: str, queued_resource_id: str, body: dict) -> None: ...
    def get_queued_resource(self, name: str) -> dict: ...
    def delete_queued_resource(self, name: str, force: bool = True) -> None: ...
    def get_node(self, name: str) -> dict: ...
    def patch_node(self, name: str, update_mask: str, body: dict) -> None: ...
    # The node's data disk: a zonal Compute Engine disk (compute v1 disks), made before the request.
    def create_disk(self, project: str, zone: str, body: dict) -> None: ...
    def get_disk(self, project: str, zone: str, name: str) -> dict: ...
    def delete_disk(self, project: str, zone: str, name: str) -> None: ...


_STATUS = {
    400: "INVALID_ARGUMENT",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
}


def discovery_service(api: str, version: str, credentials=None, endpoint: str | None = None):
    """google-api-python-client's client for `api` `version`, built from the discovery document its wheel
    ships (static_discovery, nothing fetched or cached); `endpoint` replaces the API's root."""
    from googleapiclient.discovery import build

    return build(
        api,
        version,
        credentials=credentials,
        static_discovery=True,
        cache_discovery=False,
        client_options={"api_endpoint": endpoint} if endpoint else None,
    )


def api_error(http_error) -> ApiError:
    """googleapiclient's HttpError -> ApiError with the google.rpc status the body carries."""
    code = int(getattr(http_error.resp, "status", 0) or 0)
    try:
        error = json.loads(http_error.content or b"{}").get("error", {})
    except ValueError:
        error = {}
    return ApiError(
        code,
        error.get("status") or _STATUS.get(code, "UNKNOWN"),
        error.get("message") or str(http_error),
        [d for d in error.get("details") or [] if isinstance(d, dict)],
    )


class GoogleTpuApi:
    """TpuApi over the discovery client. `endpoint` (the TPU API's root) and `compute_endpoint` (compute
    v1's base, .../compute/v1/) point it elsewhere: a private endpoint, or a local fake in the tests."""

    def __init__(
        self,
        credentials=None,
        endpoint: str | None = None,
        compute_endpoint: str | None = None,
        operation_timeout: float = 600,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._service = discovery_service("tpu", "v2alpha1", credentials, endpoint)
        self._locations = self._service.projects().locations()
        # Compute's paths carry their own prefix (servicePath compute/v1/), which an endpoint override replaces.
        compute_endpoint = compute_endpoint or (endpoint.rstrip("/") + "/compute/v1/" if endpoint else None)
        self._compute = discovery_service("compute", "v1", credentials, compute_endpoint)
        self.operation_timeout, self.sleep, self.clock = operation_timeout, sleep, clock

    def _execute(self, request, retries: int = 0) -> dict[str, Any]:
        from googleapiclient.errors import HttpError

        try:
            return request.execute(num_retries=retries)
        except HttpError as error:
            raise api_error(error) from None

    def _wait(self, operation: dict[str, Any], what: str) -> None:
        deadline = self.clock() + self.operation_timeout
        while not operation.get("done"):
            if self.clock() > deadline:
                raise ApiError(504, "DEADLINE_EXCEEDED", f"{what}: operation {operation['name']} still running")
            self.sleep(5)
            operation = self._execute(self._locations.operations().get(name=operation["name"]), retries=3)
        if "error" in operation:
            error = operation["error"]
            raise ApiError(
                int(error.get("code", 0)),
                str(error.get("status", error.get("code"))),
                error.get("message", ""),
                [d for d in error.get("details") or [] if isinstance(d, dict)],
            )

    def create_queued_resource(self, parent: str, queued_resource_id: str, body: dict) -> None:
        request = self._locations.queuedResources().create(
            parent=parent, queuedResourceId=queued_resource_id, body=body
        )
        self._wait(self._execute(request), f"create {parent}/queuedResources/{queued_resource_id}")

    def get_queued_resource(self, name: str) -> dict:
        return self._execute(self._locations.queuedResources().get(name=name), retries=3)

    def delete_queued_resource(self, name: str, force: bool = True) -> None:
        # The operation ends when the request and its nodes are gone; the provider polls the request
        # itself (with progress lines and its own deadline), so only the acceptance is awaited here.
        self._execute(self._locations.queuedResources().delete(name=name, force=force))

    def get_node(self, name: str) -> dict:
        return self._execute(self._locations.nodes().get(name=name), retries=3)

    def patch_node(self, name: str, update_mask: str, body: dict) -> None:
        request = self._locations.nodes().patch(name=name, updateMask=update_mask, body=body)
        self._wait(self._execute(request), f"patch {name}")

    def create_disk(self, project: str, zone: str, body: dict) -> None:
        operation = self._execute(self._compute.disks().insert(project=project, zone=zone, body=body))
        self._wait_zonal(project, zone, operation, f"create disk {body.get('name')} in {zone}")

    def get_disk(self, project: str, zone: str, name: str) -> dict:
        return self._execute(self._compute.disks().get(project=project, zone=zone, disk=name), retries=3)

    def delete_disk(self, project: str, zone: str, name: str) -> None:
        operation = self._execute(self._compute.disks().delete(project=project, zone=zone, disk=name))
        self._wait_zonal(project, zone, operation, f"delete disk {name} in {zone}")

    def _wait_zonal(self, project: str, zone: str, operation: dict[str, Any], what: str) -> None:
        """A compute zonal Operation: status DONE, errors under error.errors (compute v1 Operation)."""
        deadline = self.clock() + self.operation_timeout
        while operation.get("status") != "DONE":
            if self.clock() > deadline:
                raise ApiError(504, "DEADLINE_EXCEEDED", f"{what}: operation {operation['name']} still running")
            self.sleep(2)
            request = self._compute.zoneOperations().get(project=project, zone=zone, operation=operation["name"])
            operation = self._execute(request, retries=3)
        errors = (operation.get("error") or {}).get("errors") or []
        if errors:
            code = int(operation.get("httpErrorStatusCode") or 400)
            raise ApiError(
                code, _STATUS.get(code, "FAILED_PRECONDITION"), "; ".join(e.get("message", "") for e in errors)
            )
