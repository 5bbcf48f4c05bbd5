"""A stateful fake of tpu.googleapis.com v2alpha1 queued resources and nodes, on a fake clock.

It replaces the old replay fake: instead of replaying a fixed sequence of payloads per zone, it keeps
each queued resource and walks it through the states the API documents
(QueuedResourceState.state in the discovery document) as the fake clock moves:

    create -> WAITING_FOR_RESOURCES -> PROVISIONING -> ACTIVE -> SUSPENDED (preempted, flex-start end)
                                   \\-> FAILED (valid-until expired, quota)       delete -> DELETING -> gone

Every request body is checked against Google's discovery document (tests/infra/discovery.py) and the
tier / queueing-policy oneofs of the published proto (google-cloud-tpu), and refused with
INVALID_ARGUMENT like the API would; every response it builds is checked against the discovery
document too, so the fake cannot drift from the API's shapes. Failure and error messages come from
the recorded payloads in tests/infra/tpu_payloads.

`FakeTpu` implements the provider's TpuApi protocol in process; `serve_http(fake)` puts the same
state behind a local HTTP server speaking the REST API (operations included), for GoogleTpuApi.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from gemmaserve.cloud.tpu_api import ApiError
from gemmaserve.cloud.tpu_queued_resource import QueuedResourceProvider
from tests.infra.discovery import COMPUTE, TPU, supported_update_fields

PAYLOADS = Path(__file__).parent / "tpu_payloads"
# What the fake starts from: 2026-01-20T09:00:00Z, the createTime of the recorded payloads.
EPOCH = datetime(2026, 1, 20, 9, 0, tzinfo=UTC).timestamp()
PATCHABLE = supported_update_fields(TPU, "projects.locations.nodes.patch")
# google.rpc.Code numbers (https://github.com/googleapis/googleapis/blob/master/google/rpc/code.proto).
RPC_CODES = {
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
}
HTTP_CODES = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,
}


def recorded(name: str, zone: str) -> dict:
    return json.loads((PAYLOADS / f"{name}.json").read_text().replace("{zone}", zone))


def recorded_error(name: str, zone: str) -> ApiError:
    error = recorded(name, zone)["error"]
    return ApiError(error["code"], error["status"], error["message"])


def error(status: str, message: str) -> ApiError:
    return ApiError(HTTP_CODES.get(status, 500), status, message)


def service_disabled(project: str) -> ApiError:
    """403 for an API not (yet) on: the ErrorInfo Google sends with it (reason SERVICE_DISABLED, domain
    googleapis.com, https://cloud.google.com/apis/design/errors#error_info), message as the API writes it."""
    message = (
        f"Cloud TPU API has not been used in project {project} before or it is disabled. Enable it by visiting "
        f"https://console.developers.google.com/apis/api/tpu.googleapis.com/overview?project={project} then retry. "
        "If you enabled this API recently, wait a few minutes for the action to propagate to our systems and retry."
    )
    info = {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": "SERVICE_DISABLED",
        "domain": "googleapis.com",
        "metadata": {"service": "tpu.googleapis.com", "consumer": f"projects/{project}"},
    }
    return ApiError(403, "PERMISSION_DENIED", message, [info])


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def seconds(duration: str) -> float:
    return float(duration.rstrip("s"))


class FakeClock:
    """Epoch seconds that move only when the code under test sleeps (or a test advances them)."""

    def __init__(self, start: float = EPOCH):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds_: float) -> None:
        self.now += max(seconds_, 1.0)

    def advance(self, seconds_: float) -> None:
        self.now += seconds_


@dataclass
class Zone:
    """What one zone will do with a request.

    capacity_at: when capacity appears (None: never); provisioning: how long PROVISIONING lasts;
    refuse_create: a synchronous refusal (the recorded RESOURCE_EXHAUSTED, say); fail_after + failure:
    the request turns FAILED that long after creation (the recorded quota failure, say); models:
    provisioning models the zone sells, in the provider's terms (flex-start is sold in a few zones only; None: all).
    """

    capacity_at: float | None = None
    provisioning: float = 120
    refuse_create: ApiError | None = None
    fail_after: float | None = None
    failure: str = "failed_quota"
    # Older API revisions said ACCEPTED before WAITING_FOR_RESOURCES replaced it; this long, if set.
    accepted_for: float = 0
    models: frozenset[str] | None = None
    # The create is accepted (the request exists) and then this is raised to the caller: the operation
    # wait timing out or failing, a dropped connection, a credential refresh error.
    raise_after_accept: Exception | None = None


@dataclass
class Record:
    name: str
    zone: str
    body: dict[str, Any]
    created: float
    state: str = "WAITING_FOR_RESOURCES"
    initiator: str = "USER"
    failure: dict[str, Any] | None = None
    active_at: float | None = None
    terminate_at: float | None = None
    gone_at: float | None = None
    node: dict[str, Any] | None = None


@dataclass
class FakeTpu:
    """The TPU API of one project, every zone on the same fake clock."""

    clock: FakeClock = field(default_factory=FakeClock)
    zones: dict[str, Zone] = field(default_factory=dict)
    delete_seconds: float = 90
    refuse_delete: ApiError | None = None
    # This many reads of a queued resource fail with UNAVAILABLE (a flaky network, an API hiccup).
    flaky_gets: int = 0
    # This many calls (reads and creates) answer 403 SERVICE_DISABLED, as the API does for a while after it
    # was enabled (enablement is eventually consistent).
    disabled_calls: int = 0
    # One-shot faults of the caller's transport, by call: each call of that kind raises the next one. Before
    # the API acted ("create", "get", "delete": the call never arrived, or its answer was an error) or after
    # ("create-accepted", "delete-accepted": the request was made, or its deletion begun, and the caller
    # still gets the error: an operation wait that timed out, a dropped connection, a credential refresh).
    # A None lets that call through, so a fault can be aimed at the n-th call.
    faults: dict[str, list[Exception | None]] = field(default_factory=dict)
    # Over HTTP: whether a create's long-running operation ever reports done (False: the wait times out).
    create_operations_finish: bool = True
    records: dict[str, Record] = field(default_factory=dict)
    # Compute Engine disks of the project by path (projects/P/zones/Z/disks/NAME), for the nodes' dataDisks.
    disks: dict[str, dict] = field(default_factory=dict)
    calls: list[tuple] = field(default_factory=list)
    ips: itertools.count = field(default_factory=lambda: itertools.count(7))
    lock: threading.RLock = field(default_factory=threading.RLock)

    # --- what tests do to the world -----------------------------------------------------------

    def zone(self, name: str) -> Zone:
        return self.zones.setdefault(name, Zone())

    def preempt(self, name: str) -> None:
        """The service takes an ACTIVE slice back (spot preemption, maintenance): SUSPENDED, node gone."""
        with self.lock:
            self._advance()
            record = self.records[name]
            assert record.state == "ACTIVE", f"{name} is {record.state}, not ACTIVE"
            record.state, record.initiator, record.node = "SUSPENDED", "SERVICE", None

    def created_in(self) -> list[str]:
        return [c[1].split("/")[3] for c in self.calls if c[0] == "create"]

    def live(self) -> list[Record]:
        with self.lock:
            self._advance()
            return list(self.records.values())

    # --- the API --------------------------------------------------------------------------------

    def _fault(self, call: str) -> None:
        pending = self.faults.get(call)
        if pending:
            fault = pending.pop(0)  # None: this call goes through, the fault waits for a later one
            if fault is not None:
                raise fault

    def _still_disabled(self, project: str) -> None:
        if self.disabled_calls > 0:
            self.disabled_calls -= 1
            raise service_disabled(project)

    def create_queued_resource(self, parent: str, queued_resource_id: str, body: dict) -> None:
        with self.lock:
            name = f"{parent}/queuedResources/{queued_resource_id}"
            self.calls.append(("create", name, json.loads(json.dumps(body))))
            self._fault("create")
            self._still_disabled(parent.split("/")[1])
            zone = parent.split("/")[3]
            self._validate(body, zone)
            self._advance()
            if name in self.records:
                raise error("ALREADY_EXISTS", f"Resource '{name}' already exists")
            node = body["tpu"]["nodeSpec"][0]["node"]
            disk_errors = [
                e
                for disk in node.get("dataDisks") or []
                for e in self._data_disk_errors(disk.get("sourceDisk", ""), zone, node["acceleratorType"])
            ]
            if disk_errors:
                raise error("INVALID_ARGUMENT", "; ".join(disk_errors))
            spec = self.zone(zone)
            if spec.refuse_create is not None:
                raise spec.refuse_create
            # The provider's own reading of a body (one copy; tests check it against the bodies it builds).
            model = QueuedResourceProvider._provisioning_of(body)
            if spec.models is not None and model not in spec.models:
                raise error("INVALID_ARGUMENT", f"Provisioning model {model} is not supported in zone {zone}")
            first = "ACCEPTED" if spec.accepted_for else "WAITING_FOR_RESOURCES"
            self.records[name] = Record(name=name, zone=zone, body=body, created=self.clock(), state=first)
            # "get-after-create": the reads that follow an accepted create fail as well (the same flaky link).
            self.faults["get"] = self.faults.pop("get-after-create", []) + self.faults.get("get", [])
            if spec.raise_after_accept is not None:
                raise spec.raise_after_accept
            self._fault("create-accepted")

    def get_queued_resource(self, name: str) -> dict:
        with self.lock:
            self.calls.append(("get", name))
            self._fault("get")
            self._still_disabled(name.split("/")[1])
            if self.flaky_gets > 0:
                self.flaky_gets -= 1
                raise ApiError(503, "UNAVAILABLE", "The service is currently unavailable.")
            self._advance()
            return self._payload(self._record(name))

    def list_queued_resources(self, parent: str) -> list[dict]:
        with self.lock:
            self.calls.append(("list", parent))
            self._advance()
            return [self._payload(r) for r in self.records.values() if r.name.startswith(parent + "/")]

    def delete_queued_resource(self, name: str, force: bool = True) -> None:
        with self.lock:
            self.calls.append(("delete", name, force))
            self._fault("delete")
            self._advance()
            record = self._record(name)
            if self.refuse_delete is not None:
                raise self.refuse_delete
            if record.node is not None and not force:
                raise error("FAILED_PRECONDITION", f"Queued resource {name} has nodes; delete them first or use force")
            if record.state != "DELETING":
                record.state, record.initiator = "DELETING", "USER"
                record.gone_at = self.clock() + self.delete_seconds
            self._fault("delete-accepted")

    def get_node(self, name: str) -> dict:
        with self.lock:
            self.calls.append(("get_node", name))
            self._advance()
            for record in self.records.values():
                if record.node is not None and record.node["name"] == name:
                    TPU.assert_response("Node", record.node)
                    return json.loads(json.dumps(record.node))
            zone = name.split("/")[3]
            raise error("NOT_FOUND", f"Resource '{zone}/{name.rsplit('/', 1)[-1]}' was not found")

    def patch_node(self, name: str, update_mask: str, body: dict) -> None:
        with self.lock:
            self.calls.append(("patch_node", name, update_mask, json.loads(json.dumps(body))))
            errors = TPU.request_errors("Node", body, partial=True)
            fields = [f for f in update_mask.split(",") if f]
            errors += [f"updateMask {f!r} not one of {sorted(PATCHABLE)}" for f in fields if f not in PATCHABLE]
            errors += [f"updateMask names {f!r} but the body has no such field" for f in fields if f not in body]
            if errors or not fields:
                raise error("INVALID_ARGUMENT", "; ".join(errors) or "updateMask is required")
            self._advance()
            for record in self.records.values():
                if record.node is not None and record.node["name"] == name:
                    for key in fields:
                        record.node[key] = body[key]
                    return
            raise error("NOT_FOUND", f"Resource '{name}' was not found")

    # --- compute v1 disks (the nodes' data disks) -------------------------------------------------

    def create_disk(self, project: str, zone: str, body: dict) -> None:
        with self.lock:
            self.calls.append(("create_disk", zone, json.loads(json.dumps(body))))
            errors = COMPUTE.request_errors("Disk", body)
            path = f"projects/{project}/zones/{zone}/disks/{body.get('name')}"
            if not str(body.get("type", "")).startswith(f"projects/{project}/zones/{zone}/diskTypes/"):
                errors.append(f"type {body.get('type')!r} is not a disk type of zone {zone}")
            if errors:
                raise error("INVALID_ARGUMENT", "; ".join(errors))
            if path in self.disks:
                raise error("ALREADY_EXISTS", f"The resource '{path}' already exists")
            disk = {**body, "kind": "compute#disk", "zone": zone, "status": "READY", "selfLink": path}
            COMPUTE.assert_response("Disk", disk)
            self.disks[path] = disk

    def get_disk(self, project: str, zone: str, name: str) -> dict:
        with self.lock:
            self.calls.append(("get_disk", zone, name))
            path = f"projects/{project}/zones/{zone}/disks/{name}"
            if path not in self.disks:
                raise error("NOT_FOUND", f"The resource '{path}' was not found")
            return json.loads(json.dumps(self.disks[path]))

    def delete_disk(self, project: str, zone: str, name: str) -> None:
        with self.lock:
            self.calls.append(("delete_disk", zone, name))
            self._advance()
            path = f"projects/{project}/zones/{zone}/disks/{name}"
            if path not in self.disks:
                raise error("NOT_FOUND", f"The resource '{path}' was not found")
            users = [r.name for r in self.records.values() if path in self._disks_of(r)]
            if users:
                raise error("FAILED_PRECONDITION", f"The disk resource '{path}' is already being used by '{users[0]}'")
            del self.disks[path]

    @staticmethod
    def _disks_of(record: Record) -> list[str]:
        node = record.body["tpu"]["nodeSpec"][0]["node"]
        return [d.get("sourceDisk") for d in node.get("dataDisks") or []]

    # --- state machine --------------------------------------------------------------------------

    def _record(self, name: str) -> Record:
        record = self.records.get(name)
        if record is None:
            zone = name.split("/")[3]
            raise error("NOT_FOUND", recorded("error_not_found", zone)["error"]["message"])
        return record

    def _validate(self, body: dict, zone: str) -> None:
        errors = TPU.request_errors("QueuedResource", body)
        errors += oneof_errors(body)
        for spec in (body.get("tpu") or {}).get("nodeSpec") or []:
            if spec.get("parent") != f"projects/{spec.get('parent', '').split('/')[1]}/locations/{zone}":
                errors.append(f"tpu.nodeSpec.parent {spec.get('parent')!r} is not in zone {zone}")
        reservation = body.get("reservationName")
        if reservation and f"/locations/{zone}/" not in reservation:
            errors.append(f"reservationName {reservation!r} is not a reservation in zone {zone}")
        if body.get("provisioningModel") == "FLEX_START" and not (body.get("runDuration") or {}).get("maxRunDuration"):
            errors.append("FLEX_START needs runDuration.maxRunDuration")
        if errors:
            raise error("INVALID_ARGUMENT", "; ".join(errors))

    def _data_disk_errors(self, path: str, zone: str, accelerator: str) -> list[str]:
        """A data disk must exist, in the node's zone, be free for a read-write attach, and be of a type the
        TPU generation takes (cloud.google.com/tpu/docs/attach-durable-block-storage: v6e Hyperdisk
        Balanced or ML, no Persistent Disk; v5e Balanced Persistent Disk)."""
        disk = self.disks.get(path)
        if disk is None:
            return [f"dataDisks.sourceDisk {path!r} does not exist"]
        if disk["zone"] != zone:
            return [f"dataDisks.sourceDisk {path!r} is not in zone {zone}"]
        kind = disk["type"].rsplit("/", 1)[-1]
        takes = ("hyperdisk-balanced", "hyperdisk-ml") if accelerator.startswith(("v6e", "tpu7x")) else ("pd-balanced",)
        errors = [] if kind in takes else [f"{accelerator} does not attach {kind}; allowed: {', '.join(takes)}"]
        users = [r.name for r in self.records.values() if path in self._disks_of(r)]
        return errors + [f"dataDisks.sourceDisk {path!r} is attached read-write to {u}" for u in users]

    def _window(self, record: Record) -> tuple[float, float | None]:
        policy = record.body.get("queueingPolicy") or {}
        start, deadline = record.created, None
        if "validAfterTime" in policy:
            start = parse_time(policy["validAfterTime"])
        if "validAfterDuration" in policy:
            start = record.created + seconds(policy["validAfterDuration"])
        if "validInterval" in policy:
            interval = policy["validInterval"]
            start = parse_time(interval["startTime"]) if "startTime" in interval else start
            deadline = parse_time(interval["endTime"]) if "endTime" in interval else None
        if "validUntilDuration" in policy:
            deadline = record.created + seconds(policy["validUntilDuration"])
        if "validUntilTime" in policy:
            deadline = parse_time(policy["validUntilTime"])
        return max(start, record.created), deadline

    def _advance(self) -> None:
        now = self.clock()
        for name, record in list(self.records.items()):
            if record.state == "DELETING":
                if now >= record.gone_at:
                    del self.records[name]
                continue
            spec = self.zone(record.zone)
            if record.state == "ACCEPTED" and now >= record.created + spec.accepted_for:
                record.state = "WAITING_FOR_RESOURCES"
            if record.state in ("ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING"):
                start, deadline = self._window(record)
                if spec.fail_after is not None and now >= record.created + spec.fail_after:
                    record.state, record.initiator = "FAILED", "SERVICE"
                    record.failure = recorded(spec.failure, record.zone)["state"]["failedData"]["error"]
                    continue
                begins = (
                    None
                    if spec.capacity_at is None
                    else max(start, spec.capacity_at, record.created + spec.accepted_for)
                )
                if deadline is not None and (begins is None or begins >= deadline) and now >= deadline:
                    record.state, record.initiator = "FAILED", "SERVICE"
                    record.failure = {
                        "code": RPC_CODES["DEADLINE_EXCEEDED"],
                        "message": "The request could not be fulfilled before its valid-until time "
                        f"({rfc3339(deadline)}): no capacity became available in zone {record.zone}.",
                    }
                    continue
                if begins is not None and now >= begins:
                    record.state = "PROVISIONING"
                    if now >= begins + spec.provisioning:
                        self._activate(record, begins + spec.provisioning)
            if record.state == "ACTIVE" and record.terminate_at is not None and now >= record.terminate_at:
                record.state, record.initiator, record.node = "SUSPENDED", "SERVICE", None

    def _activate(self, record: Record, when: float) -> None:
        spec = record.body["tpu"]["nodeSpec"][0]
        node = json.loads(json.dumps(spec["node"]))
        name = f"{spec['parent']}/nodes/{spec['nodeId']}"
        node.update(
            name=name,
            state="READY",
            health="HEALTHY",
            createTime=rfc3339(when),
            networkEndpoints=[{"ipAddress": f"10.42.0.{next(self.ips)}", "port": 8470}],
            queuedResource=record.name,
            apiVersion="V2_ALPHA1",
            id=str(7141482963245016000 + len(self.records)),
        )
        record.state, record.active_at, record.node = "ACTIVE", when, node
        run = (record.body.get("runDuration") or {}).get("maxRunDuration")
        if run:
            record.terminate_at = when + seconds(run)

    def _payload(self, record: Record) -> dict:
        payload = json.loads(json.dumps(record.body))
        payload["name"] = record.name
        payload["createTime"] = rfc3339(record.created)
        state: dict[str, Any] = {"state": record.state, "stateInitiator": record.initiator}
        data_key = {
            "ACCEPTED": "acceptedData",
            "WAITING_FOR_RESOURCES": None,
            "PROVISIONING": "provisioningData",
            "ACTIVE": "activeData",
            "FAILED": "failedData",
            "SUSPENDED": "suspendedData",
            "DELETING": "deletingData",
        }[record.state]
        if data_key == "failedData":
            state["failedData"] = {"error": record.failure}
        elif data_key:
            state[data_key] = {}
        payload["state"] = state
        if record.terminate_at is not None:
            payload.setdefault("runDuration", {})["terminationTime"] = rfc3339(record.terminate_at)
        TPU.assert_response("QueuedResource", payload)
        return payload


def oneof_errors(body: dict) -> list[str]:
    """The proto's oneofs (google-cloud-tpu's QueuedResource descriptor): at most one member set each."""
    from google.cloud import tpu_v2alpha1

    errors = []
    descriptor = tpu_v2alpha1.QueuedResource.pb().DESCRIPTOR
    nested = {"queueingPolicy": descriptor.nested_types_by_name["QueueingPolicy"]}
    for where, message, value in [("", descriptor, body)] + [
        (f"{k}.", d, body.get(k) or {}) for k, d in nested.items()
    ]:
        for oneof in message.oneofs:
            set_ = [f.json_name for f in oneof.fields if f.json_name in value]
            if len(set_) > 1:
                errors.append(f"{where}{oneof.name}: only one of {set_} may be set")
    return errors


# --- the same fake over HTTP, for GoogleTpuApi ---------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    fake: FakeTpu
    operations: dict[str, dict]

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        path = url.path.removeprefix("/v2alpha1/")
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        fake = self.fake
        try:
            if url.path.startswith("/compute/v1/"):
                return self._compute(method, url.path.removeprefix("/compute/v1/"), body)
            if "/operations/" in path and method == "GET":
                return self._send(200, self._operation(path))
            if method == "POST" and path.endswith("/queuedResources"):
                fake.create_queued_resource(path.rsplit("/", 1)[0], query["queuedResourceId"], body)
                return self._send(200, self._start(path.rsplit("/", 1)[0], done=fake.create_operations_finish))
            if method == "GET" and "/queuedResources/" in path:
                return self._send(200, fake.get_queued_resource(path))
            if method == "DELETE" and "/queuedResources/" in path:
                fake.delete_queued_resource(path, force=query.get("force") == "true")
                return self._send(200, self._start(path, done=False, waits_for_gone=path))
            if method == "GET" and "/nodes/" in path:
                return self._send(200, fake.get_node(path))
            if method == "PATCH" and "/nodes/" in path:
                fake.patch_node(path, query.get("updateMask", ""), body)
                return self._send(200, self._start(path, done=True))
            self._send(404, {"error": {"code": 404, "status": "NOT_FOUND", "message": f"no route {method} {path}"}})
        except ApiError as failure:
            self._send(
                failure.code,
                {
                    "error": {
                        "code": failure.code,
                        "status": failure.status,
                        "message": failure.message,
                        **({"details": failure.details} if failure.details else {}),
                    }
                },
            )

    def _compute(self, method: str, path: str, body: dict | None) -> None:
        """compute v1 disks.insert/get/delete and zoneOperations.get; every operation is done at once."""
        parts = path.split("/")  # projects/P/zones/Z/(disks|operations)[/NAME]
        project, zone, kind = parts[1], parts[3], parts[4]
        if kind == "operations":
            return self._send(200, self._zonal_operation(project, zone, parts[5]))
        if method == "POST":
            self.fake.create_disk(project, zone, body)
            return self._send(200, self._zonal_operation(project, zone, f"insert-{body['name']}"))
        if method == "GET":
            return self._send(200, self.fake.get_disk(project, zone, parts[5]))
        self.fake.delete_disk(project, zone, parts[5])
        return self._send(200, self._zonal_operation(project, zone, f"delete-{parts[5]}"))

    @staticmethod
    def _zonal_operation(project: str, zone: str, name: str) -> dict:
        payload = {"kind": "compute#operation", "name": name, "zone": zone, "status": "DONE", "progress": 100}
        COMPUTE.assert_response("Operation", payload)
        return payload

    def _start(self, resource: str, done: bool, waits_for_gone: str | None = None) -> dict:
        location = "/".join(resource.split("/")[:4])
        name = f"{location}/operations/operation-{len(self.operations) + 1}"
        self.operations[name] = {"name": name, "done": done, "waits_for_gone": waits_for_gone}
        return self._operation(name)

    def _operation(self, name: str) -> dict:
        operation = self.operations[name]
        if operation["waits_for_gone"] and not operation["done"]:
            with self.fake.lock:
                self.fake._advance()
                operation["done"] = operation["waits_for_gone"] not in self.fake.records
        payload = {"name": name, "done": operation["done"]}
        if operation["done"]:
            payload["response"] = {"@type": "type.googleapis.com/google.protobuf.Empty"}
        TPU.assert_response("Operation", payload)
        return payload

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")


def serve_http(fake: FakeTpu) -> ThreadingHTTPServer:
    """Serve `fake` on 127.0.0.1 (an ephemeral port); the caller shuts it down."""
    handler = type("Handler", (_Handler,), {"fake": fake, "operations": {}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # serve_forever's default 0.5 s poll is what shutdown() waits for, at every teardown.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server
