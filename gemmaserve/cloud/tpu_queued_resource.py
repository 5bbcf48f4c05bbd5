"""A Cloud TPU queued resource as a Pulumi dynamic resource whose state in Pulumi is the state in Google Cloud.

pulumi-gcp's tpu.V2QueuedResource cannot express spot, guaranteed, valid-until or flex-start, so this
provider builds the v2alpha1 request itself (REST JSON, checked in the tests against Google's discovery
document) and runs the lifecycle an SRE expects:

- create adopts a request of the same name an interrupted run left behind, queues along the fallback
  chain (zones, then provisioning models), and returns within `create_wait_seconds` with the request's
  state in its outputs: it never holds `pulumi up` for the hours a queue can take, and once a request
  exists in Google Cloud, create never fails (so nothing is left outside Pulumi's state): a create that
  was accepted and then failed for the caller (operation timeout, dropped connection, credentials) is
  looked up and adopted, and a re-queue in update adopts what an interrupted run left first;
- read reports the real state and address; a request deleted out of band leaves Pulumi's state;
- diff asks the API: a FAILED, SUSPENDED (preempted, flex-start ended) or vanished request, or a
  flex-start slice within `recycle_before_seconds` of its end, is an update that re-queues it; labels,
  tags and metadata are patched on the node; queue settings and zone order are stored; only a change
  to the shape of a slice that holds capacity replaces it;
- delete fails loudly unless the request is really gone, and waits until it and its node are, and so
  are this resource's requests in the other zones of its chain (an interrupted re-queue leaves one there
  that the state does not name); a zone it cannot read fails the delete;
- with `data_disk`, the node's data disk (weights, image, caches) is made in the zone just before the
  request there and deleted with the request, or as soon as that zone refused it; one an interrupted
  run left in a zone without a request is deleted by the next create or re-queue.

`decide` is the one place those rules live; `gemmaserve capacity` shows its verdict and acts only by
running the stack (so the re-queue goes through this same code). The Google client is imported inside
the adapter: importing this module needs neither credentials nor the client.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pulumi
from pulumi.dynamic import (
    ConfigureRequest,
    CreateResult,
    DiffResult,
    ReadResult,
    Resource,
    ResourceProvider,
    UpdateResult,
)

from gemmaserve.cloud.tpu_api import ApiError, GoogleTpuApi, TpuApi

__all__ = ["ApiError", "QueuedResourceFailed", "QueuedResourceProvider", "TpuQueuedResource", "build_request"]

ACTIVE = "ACTIVE"
GONE = "GONE"  # not a state of the API: the request does not exist (any more)
UNKNOWN = "UNKNOWN"  # not a state of the API: it could not be read
# Queued, nothing allocated yet (ACCEPTED is what older API revisions said instead of WAITING_FOR_RESOURCES).
WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "STATE_UNSPECIFIED")
# Capacity allocated, or being allocated: never thrown away for a label.
HOLDING = ("PROVISIONING", ACTIVE, UNKNOWN)
# Nothing will come of it any more: re-queue. SUSPENDED: the service took the slice back (preemption,
# maintenance, flex-start run duration over); FAILED: the queue gave up (valid-until, quota, capacity).
DEAD = ("FAILED", "SUSPENDING", "SUSPENDED", "DELETING", GONE)
RESTART_CHAIN = ("SUSPENDING", "SUSPENDED", GONE)

# What the node is: on a slice holding capacity, a change needs a new slice.
NODE_KEYS = (
    "project",
    "queued_resource_id",
    "node_id",
    "accelerator_type",
    "runtime_version",
    "network",
    "service_account",
    "scopes",
    "enable_external_ips",
    "data_disk",
)
# Patched on the node in place (nodes.patch; its updateMask lists description, tags, labels, metadata, ...).
PATCH_KEYS = ("labels", "tags", "metadata")
# Where and how to queue.
QUEUE_KEYS = (
    "zones",
    "subnetworks",
    "provisioning",
    "fallback_provisioning",
    "flex_start_zones",
    "reservation",
    "max_run_seconds",
    "valid_until_seconds",
    "valid_after",
)
# How this provider behaves: stored, never sent.
SETTING_KEYS = ("create_wait_seconds", "recycle_before_seconds", "delete_timeout_seconds")
INPUT_KEYS = NODE_KEYS + PATCH_KEYS + QUEUE_KEYS + SETTING_KEYS
DEFAULT_CREATE_WAIT = 600
DEFAULT_DELETE_TIMEOUT = 1800
# How Compute/TPU say "this zone has no capacity right now" when they refuse a create outright.
_CAPACITY = re.compile(
    r"RESOURCE_EXHAUSTED|ZONE_RESOURCE_POOL_EXHAUSTED|STOCKOUT|no more capacity|insufficient capacity"
    r"|does not have enough resources",
    re.IGNORECASE,
)
HISTORY = 8


class QueuedResourceFailed(Exception):
    """A queued resource could not be had, or not be deleted: says which request, which state and why."""

    def __init__(self, name: str, state: str, reason: str):
        self.name, self.state, self.reason = name, state, reason
        super().__init__(f"queued resource {name} is {state}: {reason}")


def is_capacity_error(status: str, message: str) -> bool:
    return bool(_CAPACITY.search(status or "")) or bool(_CAPACITY.search(message or ""))


# google.rpc.ErrorInfo reasons (github.com/googleapis/googleapis google/api/error_reason.proto; STOCKOUT is
# error_details.proto's own example of a zone out of stock, ZONE_RESOURCE_POOL_EXHAUSTED Compute's).
QUOTA_REASONS = frozenset({"RESOURCE_QUOTA_EXCEEDED", "RATE_LIMIT_EXCEEDED", "QUOTA_EXCEEDED"})
CAPACITY_REASONS = frozenset({"STOCKOUT", "ZONE_RESOURCE_POOL_EXHAUSTED", "RESOURCE_POOL_EXHAUSTED"})
PERMISSION_REASONS = frozenset(
    {
        "IAM_PERMISSION_DENIED",
        "SERVICE_DISABLED",
        "BILLING_DISABLED",
        "ACCESS_TOKEN_SCOPE_INSUFFICIENT",
        "USER_PROJECT_DENIED",
        "CONSUMER_SUSPENDED",
    }
)
# An API enabled a moment ago answers 403 SERVICE_DISABLED for a while (enablement is eventually
# consistent; the message says "If you enabled this API recently, wait a few minutes ... and retry"):
# waited out for this long, then a permission failure like any other.
ENABLEMENT_RETRY_SECONDS = 600
TRANSIENT_STATUSES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "ABORTED"})
# A transient refusal is retried in the same zone as Google's client libraries retry: truncated exponential
# back-off with full jitter from 1 s, doubling, at most 60 s a wait, for 120 s in all (google-api-core's Retry
# defaults, google/api_core/retry/retry_base.py; cloud.google.com/storage/docs/retry-strategy).
TRANSIENT_RETRY_SECONDS = 120.0
TRANSIENT_BACKOFF = (1.0, 60.0, 2.0)  # initial, maximum, multiplier
_QUOTA = re.compile(r"\bquota\b", re.IGNORECASE)
_QUOTA_NAME = re.compile(r"[Qq]uota (?:limit |metric )?'([^']+)'")
# An accelerator type or provisioning model the zone does not sell: another zone may.
_NOT_IN_ZONE = re.compile(r"not (?:available|supported|offered)\b.*\bzone", re.IGNORECASE)


def _detail(error: ApiError, kind: str) -> list[dict]:
    return [d for d in error.details if str(d.get("@type", "")).endswith("google.rpc." + kind)]


def classify(error: ApiError) -> str:
    """quota, capacity, permission, disabled (the API not on, or not yet), not-in-zone, transient or other:
    from the details, then the status."""
    reasons = {str(d.get("reason", "")) for d in _detail(error, "ErrorInfo")}
    if "SERVICE_DISABLED" in reasons:
        return "disabled"
    if _detail(error, "QuotaFailure") or reasons & QUOTA_REASONS:
        return "quota"
    if reasons & CAPACITY_REASONS:
        return "capacity"
    if error.status == "PERMISSION_DENIED" or reasons & PERMISSION_REASONS:
        return "permission"
    if error.status in TRANSIENT_STATUSES:
        return "transient"
    if error.status == "RESOURCE_EXHAUSTED":
        # No details: RESOURCE_EXHAUSTED is both "over quota" and "no capacity"; only the message tells.
        return "quota" if _QUOTA.search(error.message or "") else "capacity"
    if error.status in ("INVALID_ARGUMENT", "FAILED_PRECONDITION") and _NOT_IN_ZONE.search(error.message or ""):
        return "not-in-zone"
    return "capacity" if is_capacity_error(error.status, error.message) else "other"


def quota_named(error: ApiError) -> str:
    """The quota a refusal names: QuotaFailure violations, ErrorInfo metadata, else the message."""
    names = [
        v.get("description") or v.get("subject")
        for d in _detail(error, "QuotaFailure")
        for v in d.get("violations") or []
    ]
    for info in _detail(error, "ErrorInfo"):
        metadata = info.get("metadata") or {}
        names += [metadata.get("quota_limit"), metadata.get("quota_metric")]
    names += _QUOTA_NAME.findall(error.message or "")
    return "; ".join(dict.fromkeys(n for n in names if n)) or error.message


def _seconds(value: float) -> str:
    return f"{int(value)}s"


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def parse_time(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- the fallback chain ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One way to ask: a zone and a provisioning model."""

    zone: str
    provisioning: str

    def __str__(self) -> str:
        return f"{self.provisioning} in {self.zone}"


def candidates(props: dict[str, Any]) -> list[Candidate]:
    """Zones in order, then the next provisioning model: reserved -> spot -> flex-start, say.

    A reservation given as a full path lives in one zone and is asked for only there; flex-start is
    asked for only in the zones that sell it (`flex_start_zones`, from the stack config).
    """
    chain = []
    reservation = props.get("reservation") or ""
    flex_zones = props.get("flex_start_zones")
    for model in [props["provisioning"], *(props.get("fallback_provisioning") or [])]:
        for zone in props["zones"]:
            if model == "reserved" and reservation.startswith("projects/") and f"/locations/{zone}/" not in reservation:
                continue
            if model == "flex-start" and flex_zones is not None and zone not in flex_zones:
                continue
            chain.append(Candidate(zone, model))
    return chain


def build_request(props: dict[str, Any], zone: str, provisioning: str | None = None) -> dict[str, Any]:
    """The v2alpha1 QueuedResource body for one candidate (REST JSON)."""
    provisioning = provisioning or props["provisioning"]
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
    if props.get("data_disk"):
        # The weights' disk, made in this zone just before the request (_ensure_disk): a TPU VM's 100 GiB boot
        # disk cannot grow, and a data disk is attached by reference to an existing zonal disk
        # (cloud.google.com/tpu/docs/attach-durable-block-storage; AttachedDisk.sourceDisk in the discovery
        # document). READ_WRITE: one node writes it (single-writer mode).
        node["dataDisks"] = [{"sourceDisk": data_disk_path(props, zone), "mode": "READ_WRITE"}]
    body: dict[str, Any] = {
        "tpu": {
            "nodeSpec": [
                {"parent": f"projects/{props['project']}/locations/{zone}", "nodeId": props["node_id"], "node": node}
            ]
        },
    }
    if provisioning == "spot":
        body["spot"] = {}
    elif provisioning == "guaranteed":
        body["guaranteed"] = {}
    elif provisioning == "reserved":
        body["guaranteed"] = {"reserved": True}
        reservation = props["reservation"]
        body["reservationName"] = (
            reservation
            if reservation.startswith("projects/")
            else f"projects/{props['project']}/locations/{zone}/reservations/{reservation}"
        )
    elif provisioning == "flex-start":
        # Flex-start (Dynamic Workload Scheduler): `gcloud compute tpus queued-resources create
        # --provisioning-model=flex-start --max-run-duration=...`. When the run duration ends the TPU VMs
        # are deleted and the queued resource turns SUSPENDED (cloud.google.com/tpu/docs/request-using-flex-start).
        body["provisioningModel"] = "FLEX_START"
        body["runDuration"] = {"maxRunDuration": _seconds(props["max_run_seconds"])}
    # "standard": no tier, i.e. on-demand capacity.
    policy: dict[str, Any] = {}
    valid_until, valid_after = props.get("valid_until_seconds"), props.get("valid_after")
    # The start constraints are one oneof in the API; with both, the request is valid for
    # `valid_until` after `valid_after`.
    if valid_after and valid_until:
        policy["validInterval"] = {"startTime": valid_after, "endTime": rfc3339(parse_time(valid_after) + valid_until)}
    elif valid_after:
        policy["validAfterTime"] = valid_after
    elif valid_until:
        policy["validUntilDuration"] = _seconds(valid_until)
    if policy:
        body["queueingPolicy"] = policy
    return body


# --- what the API says about a request ------------------------------------------------------------


def state_of(queued_resource: dict) -> str:
    return (queued_resource.get("state") or {}).get("state", "STATE_UNSPECIFIED")


def failure_reason(queued_resource: dict) -> str:
    state = queued_resource.get("state") or {}
    error = (state.get("failedData") or {}).get("error") or {}
    parts = [error.get("message")]
    if state.get("stateInitiator") and state.get("state") in ("FAILED", "SUSPENDING", "SUSPENDED"):
        parts.append(f"initiated by {state['stateInitiator']}")
    return "; ".join(p for p in parts if p)


def _deadline(queued_resource: dict) -> float | None:
    """When the queue gives up on the request (valid-until), as epoch seconds."""
    policy = queued_resource.get("queueingPolicy") or {}
    if "validUntilTime" in policy:
        return parse_time(policy["validUntilTime"])
    if "validInterval" in policy and "endTime" in policy["validInterval"]:
        return parse_time(policy["validInterval"]["endTime"])
    if "validUntilDuration" in policy and queued_resource.get("createTime"):
        return parse_time(queued_resource["createTime"]) + float(policy["validUntilDuration"].rstrip("s"))
    return None


@dataclass(frozen=True)
class Observation:
    """A request as the API last described it (or GONE / UNKNOWN)."""

    state: str
    reason: str = ""
    created_at: str | None = None
    termination_time: str | None = None
    valid_until_time: str | None = None
    raw: dict | None = None

    @classmethod
    def of(cls, queued_resource: dict) -> Observation:
        deadline = _deadline(queued_resource)
        return cls(
            state=state_of(queued_resource),
            reason=failure_reason(queued_resource),
            created_at=queued_resource.get("createTime"),
            termination_time=(queued_resource.get("runDuration") or {}).get("terminationTime"),
            valid_until_time=rfc3339(deadline) if deadline else None,
            raw=queued_resource,
        )

    @classmethod
    def stored(cls, outs: dict[str, Any]) -> Observation:
        return cls(
            state=outs.get("state") or UNKNOWN,
            reason=outs.get("state_reason") or "",
            created_at=outs.get("created_at"),
            termination_time=outs.get("termination_time"),
            valid_until_time=outs.get("valid_until_time"),
        )


def queued_resource_name(props: dict[str, Any], zone: str) -> str:
    return f"projects/{props['project']}/locations/{zone}/queuedResources/{props['queued_resource_id']}"


def node_name(props: dict[str, Any], zone: str) -> str:
    return f"projects/{props['project']}/locations/{zone}/nodes/{props['node_id']}"


def data_disk_name(props: dict[str, Any]) -> str:
    return f"{props['node_id']}-data"


def data_disk_path(props: dict[str, Any], zone: str) -> str:
    return f"projects/{props['project']}/zones/{zone}/disks/{data_disk_name(props)}"


def data_disk_body(props: dict[str, Any], zone: str) -> dict[str, Any]:
    """The compute v1 Disk for the node's data disk: type and size from the stack (config.tpu_data_disk)."""
    disk = props["data_disk"]
    return {
        "name": data_disk_name(props),
        "sizeGb": str(int(disk["size_gb"])),
        "type": f"projects/{props['project']}/zones/{zone}/diskTypes/{disk['type']}",
        "labels": dict(props.get("labels") or {}),
    }


# --- the rules ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What `pulumi up` does to a queued resource: none, store, patch, requeue or replace."""

    action: str
    why: str
    keys: tuple[str, ...] = ()
    # requeue: start again at the top of the chain (the preferred candidate), not after the current one.
    from_top: bool = False


def _norm(value: Any) -> Any:
    return value if value not in ({}, [], "", None) else None


def decide(olds: dict[str, Any], news: dict[str, Any], live: Observation, now: float) -> Decision:
    """The one place the lifecycle rules live: `diff`, `update` and `gemmaserve capacity` all ask here."""
    changed = tuple(k for k in INPUT_KEYS if _norm(olds.get(k)) != _norm(news.get(k)))
    state = live.state
    if state in DEAD:
        why = f"{state}" + (f" ({live.reason})" if live.reason else "")
        return Decision("requeue", why, changed, from_top=state in RESTART_CHAIN)
    current = Candidate(olds.get("zone") or "", olds.get("provisioning_model") or olds.get("provisioning") or "")
    recycle = news.get("recycle_before_seconds") or 0
    if (
        state == ACTIVE
        and current.provisioning == "flex-start"
        and live.termination_time
        and parse_time(live.termination_time) - now <= recycle
    ):
        return Decision("requeue", f"flex-start run ends at {live.termination_time}: recycling", changed, from_top=True)
    in_chain = current in candidates(news)
    if state in HOLDING:
        shape = [k for k in NODE_KEYS if k in changed]
        if _norm((olds.get("subnetworks") or {}).get(region_of(current.zone))) != _norm(
            (news.get("subnetworks") or {}).get(region_of(current.zone))
        ):
            shape.append("subnetworks")
        if not in_chain:
            shape.append("zones" if current.zone not in news["zones"] else "provisioning")
        if current.provisioning == "flex-start" and "max_run_seconds" in changed:
            shape.append("max_run_seconds")
        if shape:
            return Decision("replace", f"{state} slice changes shape: {', '.join(shape)}", tuple(dict.fromkeys(shape)))
        patch = tuple(k for k in PATCH_KEYS if k in changed)
        if patch:
            return Decision("patch", f"patch the node's {', '.join(patch)}", patch)
        return Decision("store", f"store {', '.join(changed)}", changed) if changed else Decision("none", state)
    # Waiting: nothing is allocated, so any change to what is asked for is a cheap re-queue.
    if not in_chain:
        return Decision("requeue", f"{current} is no longer in the fallback chain", changed, from_top=True)
    if build_request(olds, current.zone, current.provisioning) != build_request(
        news, current.zone, current.provisioning
    ):
        return Decision("requeue", "the waiting request changed", changed, from_top=True)
    return Decision("store", f"store {', '.join(changed)}", changed) if changed else Decision("none", state)


# --- the provider ---------------------------------------------------------------------------------


def _report(message: str) -> None:
    """Progress in `pulumi up` output; stderr when the engine is not there (unit tests, dynamic host quirks)."""
    try:
        pulumi.log.info(message)
    except Exception:  # noqa: BLE001 - logging must never fail a provisioning step
        print(message, file=sys.stderr)


class QueuedResourceProvider(ResourceProvider):
    """create / read / diff / update / delete for a queued resource; see the module docstring."""

    def __init__(
        self,
        api_factory: Callable[[], TpuApi] | None = None,
        poll_seconds: float = 30.0,
        progress: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ):
        super().__init__()
        self.api_factory = api_factory
        self.poll_seconds = poll_seconds
        self.progress = progress
        self.sleep = sleep
        self.clock = clock
        self.auth = None
        self.endpoints: tuple[str | None, str | None] = (None, None)

    def configure(self, req: ConfigureRequest) -> None:
        """Take the gcp provider's settings from the stack config: credentials, and the TPU and Compute
        endpoints when the stack points the gcp provider elsewhere (gcp:tpuV2CustomEndpoint,
        gcp:computeCustomEndpoint). The engine hands a dynamic provider the whole stack config, keys with
        their namespace (pulumi/pulumi v3.259.0 pkg/resource/deploy/target.go, GetPackageConfig)."""
        from gemmaserve.cloud.gcp_credentials import gcp_auth

        self.auth = gcp_auth(req.config.get, os.environ)
        tpu = req.config.get("gcp:tpuV2CustomEndpoint")
        # The gcp provider's TPU endpoint names its version (https://tpu.googleapis.com/v2/); the adapter
        # speaks v2alpha1 and adds the version itself, so only the root is kept.
        self.endpoints = (
            re.sub(r"v2[a-z0-9]*/?$", "", tpu) if tpu else None,
            req.config.get("gcp:computeCustomEndpoint"),
        )

    def _api(self) -> TpuApi:
        if self.api_factory:
            return self.api_factory()
        from gemmaserve.cloud.gcp_credentials import credentials_for, gcp_auth

        auth = self.auth or gcp_auth(lambda _key: None, os.environ)
        tpu, compute = getattr(self, "endpoints", (None, None))
        return GoogleTpuApi(credentials=credentials_for(auth), endpoint=tpu, compute_endpoint=compute)

    def _say(self, message: str) -> None:
        (self.progress or _report)(message)

    # --- create ---------------------------------------------------------------------------------

    def create(self, props: dict[str, Any]) -> CreateResult:
        api = self._api()
        outs, start = self._until_enabled(lambda: self._adopt(api, props), props["queued_resource_id"])
        if outs is None:
            outs = self._queue(api, props, start, [])
        return CreateResult(id_=props["queued_resource_id"], outs=outs)

    def _until_enabled(self, call: Callable[[], Any], what: str) -> Any:
        """`call`, again while the API answers SERVICE_DISABLED, up to ENABLEMENT_RETRY_SECONDS."""
        deadline = self.clock() + ENABLEMENT_RETRY_SECONDS
        while True:
            try:
                return call()
            except ApiError as error:
                if classify(error) != "disabled" or self.clock() >= deadline:
                    raise
                self._say(f"{what}: the API is not on yet ({error.message[:120]}); waiting for the enablement")
                self.sleep(self.poll_seconds)

    def _adopt(self, api: TpuApi, props: dict[str, Any]) -> tuple[dict[str, Any] | None, int]:
        """A request of this name an interrupted run left in any zone: adopt the live one, delete dead ones,
        and the data disks of zones that hold no request.

        Returns the adopted request's outputs, or None and where in the chain to start queueing: after
        a leftover that FAILED (that candidate was just tried), else at the top.
        """
        found, unreadable = self._requests_in_chain(api, props)
        if unreadable:
            raise next(iter(unreadable.values()))
        live = [(zone, q) for zone, q in found if state_of(q) not in DEAD]
        start, chain = 0, candidates(props)
        for zone, q in found:
            if live and (zone, q) == live[0]:
                continue
            self._say(f"{props['queued_resource_id']}: removing a leftover {state_of(q)} request in {zone}")
            self._delete_and_wait(api, queued_resource_name(props, zone), node_name(props, zone), props)
            leftover = Candidate(zone, self._provisioning_of(q))
            if state_of(q) == "FAILED" and leftover in chain:
                start = chain.index(leftover) + 1
        if not live:
            return None, start
        zone, existing = live[0]
        node = existing["tpu"]["nodeSpec"][0]["node"]
        if node.get("acceleratorType") != props["accelerator_type"]:
            raise QueuedResourceFailed(
                queued_resource_name(props, zone),
                state_of(existing),
                f"exists with acceleratorType {node.get('acceleratorType')}, this stack asks for "
                f"{props['accelerator_type']}: delete it (gcloud compute tpus queued-resources delete) or rename",
            )
        self._say(f"{props['queued_resource_id']}: adopting the existing {state_of(existing)} request in {zone}")
        observation = self._wait(api, queued_resource_name(props, zone), self.clock() + self._create_wait(props))
        return self._outs(api, props, Candidate(zone, self._provisioning_of(existing)), observation, []), 0

    def _requests_in_chain(
        self, api: TpuApi, props: dict[str, Any]
    ) -> tuple[list[tuple[str, dict]], dict[str, Exception]]:
        """This resource's requests in the zones of its chain (where create and a re-queue ask), and the zones
        that could not be read, with why. A zone that holds none loses a leftover data disk.

        Read by name, so only this queued-resource id is ever found; one of that name whose node is not the
        node this resource makes (made by hand, or by another program) is named and left alone.
        """
        found: list[tuple[str, dict]] = []
        unreadable: dict[str, Exception] = {}
        for zone in dict.fromkeys(c.zone for c in candidates(props)):
            try:
                queued = api.get_queued_resource(queued_resource_name(props, zone))
            except ApiError as error:
                if error.status != "NOT_FOUND":
                    unreadable[zone] = error
                    continue
                self._drop_leftover_disk(api, props, zone)
                continue
            except Exception as error:  # noqa: BLE001 - a transport error: what the zone holds is unknown
                unreadable[zone] = error
                continue
            specs = (queued.get("tpu") or {}).get("nodeSpec") or [{}]
            if [s.get("nodeId") for s in specs] != [props["node_id"]]:
                self._say(
                    f"{props['queued_resource_id']}: the request of this name in {zone} is for node(s) "
                    f"{', '.join(str(s.get('nodeId')) for s in specs)}, not {props['node_id']}: not this "
                    "resource's, leaving it alone"
                )
                continue
            found.append((zone, queued))
        return found, unreadable

    @staticmethod
    def _provisioning_of(queued_resource: dict) -> str:
        if queued_resource.get("provisioningModel") == "FLEX_START":
            return "flex-start"
        if "spot" in queued_resource:
            return "spot"
        if "guaranteed" in queued_resource:
            return "reserved" if queued_resource["guaranteed"].get("reserved") else "guaranteed"
        return "standard"

    @staticmethod
    def _create_wait(props: dict[str, Any]) -> float:
        wait = props.get("create_wait_seconds")
        return float(DEFAULT_CREATE_WAIT if wait is None else wait)

    def _queue(self, api: TpuApi, props: dict[str, Any], start: int, history: list[dict]) -> dict[str, Any]:
        """Ask along the chain from `start`; return the outputs of the request that now exists."""
        chain = candidates(props)
        if not chain:
            raise QueuedResourceFailed(props["queued_resource_id"], "REFUSED", "the fallback chain is empty")
        order = chain[start % len(chain) :] + chain[: start % len(chain)]
        deadline = self.clock() + self._create_wait(props)
        misses: list[str] = []
        qr_id = props["queued_resource_id"]
        for candidate in order:
            parent = f"projects/{props['project']}/locations/{candidate.zone}"
            name = f"{parent}/queuedResources/{qr_id}"
            self._say(f"{qr_id}: requesting {props['accelerator_type']} ({candidate})")
            error = self._ensure_disk(api, props, candidate.zone) or self._create(api, name, props, candidate)
            transient_until, enabled_by = (
                self.clock() + TRANSIENT_RETRY_SECONDS,
                self.clock() + ENABLEMENT_RETRY_SECONDS,
            )
            # Imported here: loading the module must not load Google's client libraries (they pull in google.auth).
            from google.api_core.retry import exponential_sleep_generator

            backoff = exponential_sleep_generator(*TRANSIENT_BACKOFF)
            while error is not None and (
                (classify(error) == "transient" and self.clock() < transient_until)
                or (classify(error) == "disabled" and self.clock() < enabled_by)
            ):
                wait = next(backoff) if classify(error) == "transient" else self.poll_seconds
                self._say(f"{qr_id}: {error.status} from the create ({error.message[:160]}); retrying in {wait:.0f} s")
                self.sleep(wait)
                error = self._ensure_disk(api, props, candidate.zone) or self._create(api, name, props, candidate)
            if error is not None:
                if error.status == "ALREADY_EXISTS":
                    adopted, _ = self._adopt(api, props)
                    if adopted is not None:
                        return adopted
                    continue
                # Nothing was queued here: the data disk made for this zone goes too (it bills by the GB).
                self._drop_disk_quietly(api, props, candidate.zone)
                kind = classify(error)
                if kind == "quota":
                    # Quota is not capacity: no other zone or hour helps until the quota is raised.
                    raise QueuedResourceFailed(
                        name, "QUOTA", f"over quota {quota_named(error)}: request an increase ({error.message})"
                    ) from error
                if kind in ("capacity", "not-in-zone", "transient"):
                    what = {"capacity": "no capacity", "not-in-zone": "not sold", "transient": "unavailable"}[kind]
                    misses.append(f"{candidate}: {error.message}")
                    history.append(self._event(candidate, "REFUSED", error.message))
                    self._say(f"{qr_id}: {what} in {candidate.zone} ({error.message}); trying the next candidate")
                    continue
                raise QueuedResourceFailed(name, "REFUSED", f"{error.status}: {error.message}") from error
            # From here on the request exists in Google Cloud: never raise, or it would be orphaned.
            observation = self._wait(api, name, deadline)
            if observation.state in ("FAILED", "SUSPENDED"):
                # Dead already: delete it and move on. Only what is really gone may be left out of the
                # outputs; a request that cannot be deleted is returned, so Pulumi keeps track of it.
                misses.append(f"{candidate}: {observation.state} {observation.reason}")
                history.append(self._event(candidate, observation.state, observation.reason))
                self._say(f"{qr_id}: {observation.state} ({observation.reason}); trying the next candidate")
                try:
                    self._delete_and_wait(api, name, node_name(props, candidate.zone), props)
                    continue
                except Exception as error:  # noqa: BLE001 - not deleted: it is returned, so Pulumi tracks it
                    self._say(f"{qr_id}: could not delete the {observation.state} request ({error!r}); keeping it")
            return self._outs(api, props, candidate, observation, history)
        raise QueuedResourceFailed(qr_id, "NO_CAPACITY", "no candidate could be queued: " + "; ".join(misses))

    def _create(self, api: TpuApi, name: str, props: dict[str, Any], candidate: Candidate) -> ApiError | None:
        """Ask for the request: None once it exists, else the API's refusal.

        A create can be accepted and still fail for the caller (the operation wait times out or errors,
        the connection drops, a credential refresh fails): the request is then queued and will bill, so
        whatever failed, the request is looked up, and one that exists (or may exist) is the caller's.
        """
        parent, qr_id = name.rsplit("/queuedResources/", 1)
        try:
            api.create_queued_resource(parent, qr_id, build_request(props, candidate.zone, candidate.provisioning))
            return None
        except Exception as error:  # noqa: BLE001 - whatever failed, the request may exist now
            if isinstance(error, ApiError) and error.status == "ALREADY_EXISTS":
                return error
            failure = error
        try:
            api.get_queued_resource(name)
        except ApiError as probe:
            if probe.status == "NOT_FOUND":
                if isinstance(failure, ApiError):
                    return failure
                raise QueuedResourceFailed(name, "REFUSED", f"the create failed: {failure!r}") from failure
            unreadable: Exception = probe
        except Exception as probe:  # noqa: BLE001 - cannot tell whether it was accepted
            unreadable = probe
        else:
            self._say(
                f"{qr_id}: the create failed after it was accepted ({failure!r}); the request exists: adopting it"
            )
            return None
        # Neither the create nor a read answered. Only an HTTP 4xx refusal of the create call itself says
        # nothing was made; anything else may have been accepted, so it is tracked (read settles it).
        if isinstance(failure, ApiError) and 400 <= failure.code < 500:
            return failure
        self._say(
            f"{qr_id}: the create failed ({failure!r}) and the request cannot be read ({unreadable!r}); tracking it"
        )
        return None

    def _ensure_disk(self, api: TpuApi, props: dict[str, Any], zone: str) -> ApiError | None:
        """Make the node's data disk in `zone` unless it is there: None once it exists, else the refusal."""
        if not props.get("data_disk"):
            return None
        try:
            api.get_disk(props["project"], zone, data_disk_name(props))
            return None
        except ApiError as error:
            if error.status != "NOT_FOUND":
                return error
        try:
            api.create_disk(props["project"], zone, data_disk_body(props, zone))
        except ApiError as error:
            return None if error.status == "ALREADY_EXISTS" else error
        self._say(
            f"{props['queued_resource_id']}: made {props['data_disk']['size_gb']} GB {props['data_disk']['type']} in {zone}"
        )
        return None

    def _drop_disk(self, api: TpuApi, props: dict[str, Any], zone: str) -> None:
        if not props.get("data_disk"):
            return
        try:
            api.delete_disk(props["project"], zone, data_disk_name(props))
        except ApiError as error:
            if error.status != "NOT_FOUND":
                raise

    def _drop_leftover_disk(self, api: TpuApi, props: dict[str, Any], zone: str) -> None:
        """In a zone that holds no request of this name, a data disk is a leftover of a run that deleted its
        request and failed before the disk: it bills by the GB and no state holds it, so it goes."""
        if not props.get("data_disk"):
            return
        try:
            api.get_disk(props["project"], zone, data_disk_name(props))
        except Exception:  # noqa: BLE001 - NOT_FOUND (nothing left over) or unreadable: leave it be
            return
        self._say(f"{props['queued_resource_id']}: deleting a leftover {data_disk_path(props, zone)}")
        self._drop_disk_quietly(api, props, zone)

    def _drop_disk_quietly(self, api: TpuApi, props: dict[str, Any], zone: str) -> None:
        try:
            self._drop_disk(api, props, zone)
        except ApiError as error:
            self._say(f"{props['queued_resource_id']}: could not delete {data_disk_path(props, zone)} ({error})")

    def _event(self, candidate: Candidate, state: str, reason: str) -> dict[str, str]:
        return {
            "at": rfc3339(self.clock()),
            "zone": candidate.zone,
            "provisioning": candidate.provisioning,
            "state": state,
            "reason": reason[:300],
        }

    def _wait(self, api: TpuApi, name: str, deadline: float) -> Observation:
        """Poll until ACTIVE, dead, or the deadline; errors while reading (API errors, and transport errors
        as well: the request this waits on exists) end the wait as UNKNOWN, never raise."""
        started, seen, errors = self.clock(), None, 0
        short = name.rsplit("/", 1)[-1]
        while True:
            try:
                queued = api.get_queued_resource(name)
            except Exception as error:  # noqa: BLE001 - a read timing out must not raise past a live request
                if isinstance(error, ApiError) and error.status == "NOT_FOUND":
                    return Observation(GONE)
                errors += 1
                self._say(f"{short}: could not read its state ({error})")
                if errors >= 3 or self.clock() >= deadline:
                    return Observation(UNKNOWN, f"last read failed: {error}")
                self.sleep(self.poll_seconds)
                continue
            observation = Observation.of(queued)
            if observation.state != seen:
                self._say(f"{short}: {observation.state} after {int(self.clock() - started)} s")
                seen = observation.state
            if observation.state == ACTIVE or observation.state in DEAD or self.clock() >= deadline:
                return observation
            self.sleep(self.poll_seconds)

    def _outs(
        self, api: TpuApi, props: dict[str, Any], candidate: Candidate, observation: Observation, history: list[dict]
    ) -> dict[str, Any]:
        internal = external = None
        workers: list[str] = []
        if observation.state == ACTIVE:
            try:
                endpoints = api.get_node(node_name(props, candidate.zone)).get("networkEndpoints") or [{}]
                internal = endpoints[0].get("ipAddress")
                external = (endpoints[0].get("accessConfig") or {}).get("externalIp") or None
                # One entry per TPU VM of the slice: every worker, so a slice of several VMs is never
                # mistaken for its first host (the spec refuses those: AcceleratorSpec, max_devices_per_host).
                workers = [e["ipAddress"] for e in endpoints if e.get("ipAddress")]
                if len(workers) > 1:
                    self._say(f"{props['node_id']}: {len(workers)} workers ({', '.join(workers)}), not one host")
            except Exception as error:  # noqa: BLE001 - the request exists: its outputs are returned regardless
                self._say(f"{props['node_id']}: could not read the node's address ({error!r})")
        return {
            **{k: props.get(k) for k in INPUT_KEYS},
            "zone": candidate.zone,
            "provisioning_model": candidate.provisioning,
            "queued_resource_name": queued_resource_name(props, candidate.zone),
            "node_name": node_name(props, candidate.zone),
            "state": observation.state,
            "state_reason": observation.reason or None,
            "created_at": observation.created_at,
            "termination_time": observation.termination_time,
            "valid_until_time": observation.valid_until_time,
            "internal_ip": internal,
            "external_ip": external,
            "worker_ips": workers,
            "history": (list(props.get("history") or []) + history)[-HISTORY:],
        }

    # --- read / diff / update ---------------------------------------------------------------------

    def _observe(self, api: TpuApi, outs: dict[str, Any]) -> Observation:
        name = outs.get("queued_resource_name") or queued_resource_name(outs, outs["zone"])
        try:
            return Observation.of(api.get_queued_resource(name))
        except ApiError as error:
            if error.status == "NOT_FOUND":
                return Observation(GONE, "the request no longer exists")
            raise

    def read(self, id_: str, props: dict[str, Any]) -> ReadResult:
        api = self._api()
        observation = self._observe(api, props)
        if observation.state == GONE:
            return ReadResult(id_="", outs={})
        candidate = Candidate(props["zone"], props.get("provisioning_model") or props["provisioning"])
        return ReadResult(id_=id_, outs=self._outs(api, props, candidate, observation, []))

    def diff(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        try:
            live = self._observe(self._api(), olds)
        except Exception as error:  # noqa: BLE001 - a preview without API access still diffs the inputs
            self._say(f"{id_}: cannot read the live state ({error}); diffing against the stored state")
            live = Observation.stored(olds)
        decision = decide(olds, news, live, self.clock())
        if decision.action not in ("none", "store"):
            self._say(f"{id_}: {decision.action}: {decision.why}")
        if decision.action == "replace":
            return DiffResult(changes=True, replaces=list(decision.keys), delete_before_replace=True)
        return DiffResult(changes=decision.action != "none", replaces=[], delete_before_replace=True)

    def update(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        api = self._api()
        live = self._observe(api, olds)
        decision = decide(olds, news, live, self.clock())
        self._say(f"{id_}: {decision.action}: {decision.why}")
        history = list(olds.get("history") or [])
        if decision.action == "requeue":
            current = Candidate(olds["zone"], olds.get("provisioning_model") or olds["provisioning"])
            if live.state != GONE:
                self._delete_and_wait(api, olds["queued_resource_name"], olds["node_name"], news)
            history.append(self._event(current, live.state, live.reason or decision.why))
            # A request of this name an interrupted run left in another zone is adopted, not doubled.
            adopted, _ = self._adopt(api, {**news, "history": history})
            if adopted is not None:
                return UpdateResult(outs=adopted)
            chain = candidates(news)
            start = 0 if decision.from_top or current not in chain else chain.index(current) + 1
            return UpdateResult(outs=self._queue(api, {**news, "history": history}, start, []))
        if decision.action == "replace":
            raise QueuedResourceFailed(olds["queued_resource_name"], live.state, decision.why + " (run up again)")
        candidate = Candidate(olds["zone"], olds.get("provisioning_model") or olds["provisioning"])
        if decision.action == "patch" and live.state == ACTIVE:
            body = {key: (news.get(key) or ({} if key != "tags" else [])) for key in decision.keys}
            api.patch_node(olds["node_name"], ",".join(decision.keys), body)
        outs = self._outs(api, {**news, "history": history}, candidate, live, [])
        return UpdateResult(outs=outs)

    # --- delete -----------------------------------------------------------------------------------

    def delete(self, id_: str, props: dict[str, Any]) -> None:
        """Delete the request the state names, then any other of this resource's in the zones of its chain.

        An `up` killed in a re-queue after Google accepted the create leaves a request in another zone that
        the state does not name; a destroy that then deleted only the named one would leave it queued, and
        billing once it is ACTIVE. A zone that cannot be read fails the delete (naming it): only a destroy
        that can tell nothing is left returns, and the engine keeps the resource in the state for a retry.
        """
        api = self._api()
        zone = props.get("zone") or props["zones"][0]
        name = props.get("queued_resource_name") or queued_resource_name(props, zone)
        self._delete_and_wait(api, name, props.get("node_name") or node_name(props, zone), props)
        found, unreadable = self._requests_in_chain(api, props)
        for other, queued in found:
            self._say(
                f"{props['queued_resource_id']}: deleting the {state_of(queued)} request in {other} too "
                f"(the state names {zone}: an interrupted run left it)"
            )
            self._delete_and_wait(api, queued_resource_name(props, other), node_name(props, other), props)
        if unreadable:
            why = "; ".join(f"{z}: {error!r}" for z, error in unreadable.items())
            raise QueuedResourceFailed(
                props["queued_resource_id"],
                UNKNOWN,
                f"could not read {', '.join(unreadable)} ({why}), where a request of this resource may be left: "
                "run the destroy again",
            )

    def _delete_and_wait(self, api: TpuApi, name: str, node: str, props: dict[str, Any]) -> None:
        """Delete the request (force: its node goes with it) and return only once both are gone."""
        zone = name.split("/")[3]
        try:
            api.delete_queued_resource(name, force=True)
        except ApiError as error:
            if error.status == "NOT_FOUND":
                self._drop_disk(api, props, zone)
                return
            raise
        timeout = float(props.get("delete_timeout_seconds") or DEFAULT_DELETE_TIMEOUT)
        started = self.clock()
        state = "DELETING"
        short = name.rsplit("/", 1)[-1]
        while self.clock() - started < timeout:
            try:
                state = state_of(api.get_queued_resource(name))
            except ApiError as error:
                if error.status != "NOT_FOUND":
                    raise
                try:
                    api.get_node(node)
                    state = "NODE_STILL_PRESENT"
                except ApiError as node_error:
                    if node_error.status == "NOT_FOUND":
                        # Detached with the node: the data disk can go now, and must (it bills on its own).
                        self._drop_disk(api, props, zone)
                        self._say(f"{short}: deleted after {int(self.clock() - started)} s")
                        return
                    raise
            self.sleep(self.poll_seconds)
        raise QueuedResourceFailed(
            name, state, f"still there {int(timeout)} s after the delete (delete_timeout_seconds)"
        )


class TpuQueuedResource(Resource):
    """The dynamic resource; `props` are INPUT_KEYS (see TpuSlice)."""

    zone: pulumi.Output[str]
    provisioning_model: pulumi.Output[str]
    queued_resource_name: pulumi.Output[str]
    node_name: pulumi.Output[str]
    state: pulumi.Output[str]
    state_reason: pulumi.Output[str | None]
    internal_ip: pulumi.Output[str | None]
    external_ip: pulumi.Output[str | None]
    termination_time: pulumi.Output[str | None]

    def __init__(
        self,
        name: str,
        props: dict[str, Any],
        opts: pulumi.ResourceOptions | None = None,
        provider: ResourceProvider | None = None,
    ):
        outputs = dict.fromkeys(
            (
                "zone",
                "provisioning_model",
                "queued_resource_name",
                "node_name",
                "state",
                "state_reason",
                "created_at",
                "termination_time",
                "valid_until_time",
                "internal_ip",
                "external_ip",
                "worker_ips",
                "history",
            )
        )
        super().__init__(provider or QueuedResourceProvider(), name, {**outputs, **props}, opts)
