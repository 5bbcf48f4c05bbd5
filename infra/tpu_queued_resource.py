"""A Cloud TPU queued resource as a Pulumi dynamic resource, on the official google-cloud-tpu v2alpha1 client.

pulumi-gcp's tpu.V2QueuedResource cannot express spot, guaranteed, valid-until or flex-start, so this
provider builds the v2alpha1 request itself and handles the states the queue goes through:
create -> (WAITING_FOR_RESOURCES | PROVISIONING ...) -> ACTIVE, or FAILED / SUSPENDED, which are
reported with their reason and deleted so they stop holding quota. Zones are tried in order while
the answer is "no capacity". The google client is imported inside the adapter, so importing this
module (and unit-testing the request and state logic) needs neither credentials nor the client.

Payloads are REST JSON (camelCase, as `gcloud ... describe --format=json` prints them): the same
shape the fake client in tests/infra replays from recorded responses.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from datetime import UTC
from typing import Any, Protocol

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, ReadResult, Resource, ResourceProvider

ACTIVE = "ACTIVE"
FAILED_STATES = ("FAILED", "SUSPENDED")
# Fields that shape the request: changing any of them needs a new queued resource (the API has no update).
REQUEST_KEYS = (
    "project",
    "zones",
    "queued_resource_id",
    "node_id",
    "accelerator_type",
    "runtime_version",
    "provisioning",
    "reservation",
    "max_run_seconds",
    "valid_until_seconds",
    "valid_after",
    "network",
    "subnetworks",
    "service_account",
    "scopes",
    "labels",
    "tags",
    "metadata",
    "enable_external_ips",
)
# How Compute/TPU say "this zone has no capacity right now" (status names and message fragments).
_CAPACITY = re.compile(
    r"RESOURCE_EXHAUSTED|ZONE_RESOURCE_POOL_EXHAUSTED|STOCKOUT|no more capacity|insufficient capacity"
    r"|does not have enough resources|capacity",
    re.IGNORECASE,
)
TPU_API = "https://tpu.googleapis.com/v2alpha1"


class ApiError(Exception):
    """An API call refused: HTTP code, canonical status (RESOURCE_EXHAUSTED, NOT_FOUND, ...) and message."""

    def __init__(self, code: int, status: str, message: str):
        self.code, self.status, self.message = code, status, message
        super().__init__(f"{status} ({code}): {message}")


class QueuedResourceFailed(Exception):
    """The queued resource ended FAILED or SUSPENDED (or timed out); says which state and why."""

    def __init__(self, name: str, state: str, reason: str):
        self.name, self.state, self.reason = name, state, reason
        self.capacity = bool(_CAPACITY.search(reason))
        super().__init__(f"queued resource {name} is {state}: {reason}")


def is_capacity_error(status: str, message: str) -> bool:
    return bool(_CAPACITY.search(status or "")) or bool(_CAPACITY.search(message or ""))


class TpuApi(Protocol):
    """What the provider needs from the TPU API, in REST JSON."""

    def create_queued_resource(self, parent: str, queued_resource_id: str, body: dict) -> None: ...
    def get_queued_resource(self, name: str) -> dict: ...
    def delete_queued_resource(self, name: str) -> None: ...
    def get_node(self, name: str) -> dict: ...


def _seconds(value: int) -> str:
    return f"{int(value)}s"


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def build_request(props: dict[str, Any], zone: str) -> dict[str, Any]:
    """The v2alpha1 QueuedResource body for one zone (REST JSON)."""
    node: dict[str, Any] = {
        "acceleratorType": props["accelerator_type"],
        "runtimeVersion": props["runtime_version"],
        "networkConfig": {
            "network": props["network"],
            "subnetwork": props["subnetworks"][region_of(zone)],
            # No public IPs: the subnet has Private Google Access and the region a Cloud NAT.
            "enableExternalIps": bool(props.get("enable_external_ips", False)),
        },
        "serviceAccount": {"email": props["service_account"], "scope": list(props["scopes"])},
        "labels": dict(props.get("labels") or {}),
        "tags": list(props.get("tags") or []),
    }
    if props.get("metadata"):
        node["metadata"] = dict(props["metadata"])
    body: dict[str, Any] = {
        "tpu": {
            "nodeSpec": [
                {
                    "parent": f"projects/{props['project']}/locations/{zone}",
                    "nodeId": props["node_id"],
                    "node": node,
                }
            ]
        },
    }
    provisioning = props["provisioning"]
    if provisioning == "spot":
        body["spot"] = {}
    elif provisioning == "guaranteed":
        body["guaranteed"] = {}
    elif provisioning == "reserved":
        body["guaranteed"] = {"reserved": True}
        body["reservationName"] = (
            props["reservation"]
            if props["reservation"].startswith("projects/")
            else f"projects/{props['project']}/locations/{zone}/reservations/{props['reservation']}"
        )
    elif provisioning == "flex-start":
        # Flex-start (Dynamic Workload Scheduler): what `gcloud alpha compute tpus queued-resources create
        # --provisioning-model=flex-start --max-run-duration=...` sends. The v2alpha1 proto in
        # google-cloud-tpu <= 1.28 does not carry these fields yet; GoogleTpuApi sends them over REST.
        # When the run duration ends the TPU VMs are deleted and the queued resource turns SUSPENDED.
        body["provisioningModel"] = "FLEX_START"
        body["runDuration"] = {"maxRunDuration": _seconds(props["max_run_seconds"])}
    # "standard": no tier, i.e. on-demand capacity.
    policy: dict[str, Any] = {}
    valid_until, valid_after = props.get("valid_until_seconds"), props.get("valid_after")
    # The start constraints are one oneof in the API; with both, the request is valid for
    # `valid_until` after `valid_after`.
    if valid_after and valid_until:
        start = _parse_time(valid_after)
        policy["validInterval"] = {"startTime": valid_after, "endTime": _rfc3339(start + valid_until)}
    elif valid_after:
        policy["validAfterTime"] = valid_after
    elif valid_until:
        policy["validUntilDuration"] = _seconds(valid_until)
    if policy:
        body["queueingPolicy"] = policy
    return body


def _parse_time(value: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _rfc3339(epoch: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def state_of(queued_resource: dict) -> str:
    return (queued_resource.get("state") or {}).get("state", "STATE_UNSPECIFIED")


def failure_reason(queued_resource: dict) -> str:
    state = queued_resource.get("state") or {}
    error = (state.get("failedData") or {}).get("error") or {}
    parts = [error.get("message")]
    if state.get("stateInitiator"):
        parts.append(f"initiated by {state['stateInitiator']}")
    return "; ".join(p for p in parts if p) or "no reason given by the API"


def _report(message: str) -> None:
    """Progress in `pulumi up` output; stderr when the engine is not there (unit tests, dynamic host quirks)."""
    try:
        pulumi.log.info(message)
    except Exception:  # noqa: BLE001 - logging must never fail a provisioning step
        print(message, file=sys.stderr)


class GoogleTpuApi:
    """TpuApi over google-cloud-tpu's v2alpha1 TpuClient (Application Default Credentials)."""

    def __init__(self):
        from google.cloud import tpu_v2alpha1

        self._tpu = tpu_v2alpha1
        self._client = tpu_v2alpha1.TpuClient()

    def _call(self, fn: Callable, *args, **kwargs):
        from google.api_core import exceptions

        try:
            return fn(*args, **kwargs)
        except exceptions.GoogleAPICallError as error:
            status = error.grpc_status_code.name if error.grpc_status_code else str(error.code)
            raise ApiError(int(error.code or 0), status, error.message) from error

    def create_queued_resource(self, parent: str, queued_resource_id: str, body: dict) -> None:
        from google.protobuf.json_format import ParseError

        try:
            message = self._tpu.QueuedResource.from_json(json.dumps(body))
        except ParseError:
            # Fields newer than the installed proto (flex-start): same API, over REST.
            return self._create_over_rest(parent, queued_resource_id, body)
        operation = self._call(
            self._client.create_queued_resource,
            parent=parent,
            queued_resource_id=queued_resource_id,
            queued_resource=message,
        )
        self._call(operation.result, timeout=600)

    def _create_over_rest(self, parent: str, queued_resource_id: str, body: dict) -> None:
        import google.auth
        from google.auth.transport.requests import AuthorizedSession

        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        session = AuthorizedSession(credentials)
        response = session.post(
            f"{TPU_API}/{parent}/queuedResources",
            params={"queuedResourceId": queued_resource_id},
            json=body,
            timeout=60,
        )
        operation = self._rest_json(response)
        while not operation.get("done"):
            time.sleep(5)
            operation = self._rest_json(session.get(f"{TPU_API}/{operation['name']}", timeout=60))
        if "error" in operation:
            error = operation["error"]
            raise ApiError(
                int(error.get("code", 0)), str(error.get("status", error.get("code"))), error.get("message", "")
            )

    @staticmethod
    def _rest_json(response) -> dict:
        payload = response.json() if response.content else {}
        if response.status_code >= 400:
            error = payload.get("error", {})
            raise ApiError(response.status_code, error.get("status", "UNKNOWN"), error.get("message", response.text))
        return payload

    def get_queued_resource(self, name: str) -> dict:
        message = self._call(self._client.get_queued_resource, name=name)
        return json.loads(self._tpu.QueuedResource.to_json(message, use_integers_for_enums=False))

    def delete_queued_resource(self, name: str) -> None:
        request = self._tpu.DeleteQueuedResourceRequest(name=name, force=True)
        operation = self._call(self._client.delete_queued_resource, request=request)
        self._call(operation.result, timeout=900)

    def get_node(self, name: str) -> dict:
        message = self._call(self._client.get_node, name=name)
        return json.loads(self._tpu.Node.to_json(message, use_integers_for_enums=False))


class QueuedResourceProvider(ResourceProvider):
    """create / read / delete / diff for a queued resource; replacement on any request change."""

    def __init__(
        self,
        api_factory: Callable[[], TpuApi] | None = None,
        poll_seconds: float = 30.0,
        progress: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.api_factory = api_factory
        self.poll_seconds = poll_seconds
        self.progress = progress
        self.sleep = sleep
        self.clock = clock

    def _api(self) -> TpuApi:
        return self.api_factory() if self.api_factory else GoogleTpuApi()

    def _say(self, message: str) -> None:
        (self.progress or _report)(message)

    def create(self, props: dict[str, Any]) -> CreateResult:
        api = self._api()
        qr_id, misses = props["queued_resource_id"], []
        for position, zone in enumerate(props["zones"]):
            parent = f"projects/{props['project']}/locations/{zone}"
            name = f"{parent}/queuedResources/{qr_id}"
            last_zone = position == len(props["zones"]) - 1
            self._say(f"{qr_id}: requesting {props['accelerator_type']} ({props['provisioning']}) in {zone}")
            try:
                api.create_queued_resource(parent, qr_id, build_request(props, zone))
            except ApiError as error:
                if is_capacity_error(error.status, error.message):
                    misses.append(f"{zone}: {error.message}")
                    self._say(f"{qr_id}: no capacity in {zone} ({error.message}); trying the next zone")
                    continue
                raise QueuedResourceFailed(name, "REFUSED", f"{error.status}: {error.message}") from error
            try:
                queued = self._wait_active(api, name, props)
            except QueuedResourceFailed as failure:
                # Never leave a failed request holding quota (or blocking the id in this zone).
                self._say(f"{qr_id}: {failure.state} in {zone} ({failure.reason}); deleting it")
                self._delete_quietly(api, name)
                if failure.capacity and not last_zone:
                    misses.append(f"{zone}: {failure.reason}")
                    continue
                raise
            return CreateResult(id_=name, outs=self._outs(api, props, zone, name, queued))
        raise QueuedResourceFailed(f"{qr_id}", "NO_CAPACITY", "no zone had capacity: " + "; ".join(misses))

    def _wait_active(self, api: TpuApi, name: str, props: dict[str, Any]) -> dict:
        started, seen = self.clock(), None
        timeout = float(props.get("wait_timeout_seconds") or 3 * 3600)
        while True:
            queued = api.get_queued_resource(name)
            state = state_of(queued)
            if state != seen:
                self._say(f"{name.rsplit('/', 1)[-1]}: {state} after {int(self.clock() - started)} s")
                seen = state
            if state == ACTIVE:
                return queued
            if state in FAILED_STATES:
                raise QueuedResourceFailed(name, state, failure_reason(queued))
            if self.clock() - started > timeout:
                raise QueuedResourceFailed(name, state, f"not ACTIVE within {int(timeout)} s (wait_timeout_seconds)")
            self.sleep(self.poll_seconds)

    def _delete_quietly(self, api: TpuApi, name: str) -> None:
        try:
            api.delete_queued_resource(name)
        except ApiError as error:
            if error.status != "NOT_FOUND":
                self._say(f"could not delete {name}: {error}; delete it by hand to release quota")

    def _outs(self, api: TpuApi, props: dict[str, Any], zone: str, name: str, queued: dict) -> dict[str, Any]:
        node_name = f"projects/{props['project']}/locations/{zone}/nodes/{props['node_id']}"
        try:
            node = api.get_node(node_name)
        except ApiError:
            node = {}
        endpoints = node.get("networkEndpoints") or [{}]
        external = (endpoints[0].get("accessConfig") or {}).get("externalIp") or None
        return {
            **props,
            "zone": zone,
            "queued_resource_name": name,
            "node_name": node_name,
            "state": state_of(queued),
            "internal_ip": endpoints[0].get("ipAddress"),
            "external_ip": external,
        }

    def read(self, id_: str, props: dict[str, Any]) -> ReadResult:
        api = self._api()
        try:
            queued = api.get_queued_resource(id_)
        except ApiError as error:
            if error.status == "NOT_FOUND":
                return ReadResult(id_="", outs={})
            raise
        return ReadResult(id_=id_, outs={**props, "state": state_of(queued)})

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        self._delete_quietly(self._api(), id_)

    def diff(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        changed = [key for key in REQUEST_KEYS if olds.get(key) != news.get(key)]
        # The API has no update: a changed request is a new queued resource, deleted first (same id).
        return DiffResult(changes=bool(changed), replaces=changed, delete_before_replace=True)


class TpuQueuedResource(Resource):
    """The dynamic resource; `props` are the REQUEST_KEYS plus wait_timeout_seconds."""

    zone: pulumi.Output[str]
    queued_resource_name: pulumi.Output[str]
    state: pulumi.Output[str]
    internal_ip: pulumi.Output[str]
    external_ip: pulumi.Output[str | None]

    def __init__(
        self,
        name: str,
        props: dict[str, Any],
        opts: pulumi.ResourceOptions | None = None,
        provider: ResourceProvider | None = None,
    ):
        outputs = {
            "zone": None,
            "queued_resource_name": None,
            "node_name": None,
            "state": None,
            "internal_ip": None,
            "external_ip": None,
        }
        super().__init__(provider or QueuedResourceProvider(), name, {**outputs, **props}, opts)
