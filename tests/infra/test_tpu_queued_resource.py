"""The TPU queued-resource provider against a fake client replaying v2alpha1 payloads: requests and states."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from google.cloud import tpu_v2alpha1
from tpu_queued_resource import (
    ApiError,
    QueuedResourceFailed,
    QueuedResourceProvider,
    build_request,
    is_capacity_error,
)

from tests.infra.conftest import INFRA

PAYLOADS = Path(__file__).parent / "tpu_payloads"
PROJECT = "gemmaserve-test"
ZONES = ["us-east5-b", "us-east5-a", "us-east1-d"]


def payload(name: str, zone: str) -> dict:
    return json.loads((PAYLOADS / f"{name}.json").read_text().replace("{zone}", zone))


def api_error(name: str, zone: str) -> ApiError:
    error = payload(name, zone)["error"]
    return ApiError(error["code"], error["status"], error["message"])


class ReplayTpuApi:
    """Answers like the TPU API: per zone, a create error or a sequence of queued-resource states."""

    def __init__(self, states: dict[str, list[str]], create_errors: dict[str, str] | None = None):
        self.states = {zone: list(seq) for zone, seq in states.items()}
        self.create_errors = create_errors or {}
        self.calls: list[tuple] = []
        self.deleted: list[str] = []

    @staticmethod
    def _zone(name: str) -> str:
        return name.split("/")[3]

    def create_queued_resource(self, parent: str, queued_resource_id: str, body: dict) -> None:
        zone = parent.split("/")[-1]
        self.calls.append(("create", zone, queued_resource_id, body))
        if zone in self.create_errors:
            raise api_error(self.create_errors[zone], zone)

    def get_queued_resource(self, name: str) -> dict:
        zone = self._zone(name)
        self.calls.append(("get", zone))
        if name in self.deleted or zone not in self.states:
            raise api_error("error_not_found", zone)
        sequence = self.states[zone]
        return payload(sequence.pop(0) if len(sequence) > 1 else sequence[0], zone)

    def delete_queued_resource(self, name: str) -> None:
        self.calls.append(("delete", self._zone(name)))
        self.deleted.append(name)

    def get_node(self, name: str) -> dict:
        return payload("node_ready", self._zone(name))


def props(**changes) -> dict:
    base = {
        "project": PROJECT,
        "zones": ZONES,
        "queued_resource_id": "gs-tpu-v6e4-tpu-qr",
        "node_id": "gs-tpu-v6e4-tpu-qr-node",
        "accelerator_type": "v6e-4",
        "runtime_version": "v2-alpha-tpuv6e",
        "provisioning": "guaranteed",
        "network": f"projects/{PROJECT}/global/networks/vpc",
        "subnetworks": {
            "us-east5": f"projects/{PROJECT}/regions/us-east5/subnetworks/a",
            "us-east1": f"projects/{PROJECT}/regions/us-east1/subnetworks/b",
        },
        "service_account": f"hosts@{PROJECT}.iam.gserviceaccount.com",
        "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
        "labels": {"app": "gemmaserve"},
        "tags": ["gemmaserve-host"],
        "enable_external_ips": False,
        "valid_until_seconds": 21600,
        "wait_timeout_seconds": 3600,
    }
    return {**base, **changes}


def provider(api: ReplayTpuApi, messages: list[str] | None = None, clock=None) -> QueuedResourceProvider:
    kwargs = {"clock": clock} if clock else {}
    return QueuedResourceProvider(
        api_factory=lambda: api,
        poll_seconds=0,
        sleep=lambda _: None,
        progress=(messages.append if messages is not None else lambda _: None),
        **kwargs,
    )


# --- request building ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "provisioning, extra, tier",
    [
        ("standard", {}, {}),
        ("spot", {}, {"spot": {}}),
        ("guaranteed", {}, {"guaranteed": {}}),
        (
            "reserved",
            {"reservation": "v6e-pool"},
            {
                "guaranteed": {"reserved": True},
                "reservationName": f"projects/{PROJECT}/locations/us-east5-a/reservations/v6e-pool",
            },
        ),
        (
            "flex-start",
            {"max_run_seconds": 7 * 86400},
            {"provisioningModel": "FLEX_START", "runDuration": {"maxRunDuration": "604800s"}},
        ),
    ],
)
def test_request_tier_for_each_provisioning_model(provisioning, extra, tier):
    body = build_request(props(provisioning=provisioning, **extra), "us-east5-a")
    tiers = {
        k: v
        for k, v in body.items()
        if k in ("spot", "guaranteed", "bestEffort", "reservationName", "provisioningModel", "runDuration")
    }
    assert tiers == tier


def test_request_node_defaults():
    body = build_request(props(), "us-east1-d")
    spec = body["tpu"]["nodeSpec"][0]
    assert spec["parent"] == f"projects/{PROJECT}/locations/us-east1-d"
    assert spec["nodeId"] == "gs-tpu-v6e4-tpu-qr-node"
    node = spec["node"]
    assert (node["acceleratorType"], node["runtimeVersion"]) == ("v6e-4", "v2-alpha-tpuv6e")
    # The zone's own region's subnet; no public IPs.
    assert node["networkConfig"] == {
        "network": f"projects/{PROJECT}/global/networks/vpc",
        "subnetwork": f"projects/{PROJECT}/regions/us-east1/subnetworks/b",
        "enableExternalIps": False,
    }
    assert node["serviceAccount"] == {
        "email": f"hosts@{PROJECT}.iam.gserviceaccount.com",
        "scope": ["https://www.googleapis.com/auth/cloud-platform"],
    }
    assert node["labels"] == {"app": "gemmaserve"} and node["tags"] == ["gemmaserve-host"]


@pytest.mark.parametrize(
    "changes, policy",
    [
        ({"valid_until_seconds": 21600}, {"validUntilDuration": "21600s"}),
        (
            {"valid_until_seconds": None, "valid_after": "2026-02-01T08:00:00+00:00"},
            {"validAfterTime": "2026-02-01T08:00:00+00:00"},
        ),
        (
            {"valid_until_seconds": 7200, "valid_after": "2026-02-01T08:00:00Z"},
            {"validInterval": {"startTime": "2026-02-01T08:00:00Z", "endTime": "2026-02-01T10:00:00Z"}},
        ),
    ],
)
def test_queueing_policy(changes, policy):
    assert build_request(props(**changes), "us-east5-b")["queueingPolicy"] == policy


@pytest.mark.parametrize(
    "provisioning, extra", [("standard", {}), ("spot", {}), ("guaranteed", {}), ("reserved", {"reservation": "pool"})]
)
def test_request_is_a_valid_v2alpha1_queued_resource(provisioning, extra):
    # Unknown or misspelled field names raise here: the request matches the official client's schema.
    body = build_request(props(provisioning=provisioning, valid_after="2026-02-01T08:00:00Z", **extra), "us-east5-b")
    message = tpu_v2alpha1.QueuedResource.from_json(json.dumps(body))
    node = message.tpu.node_spec[0].node
    assert node.accelerator_type == "v6e-4" and node.network_config.enable_external_ips is False


def test_flex_start_fields_are_newer_than_the_installed_proto():
    # Why GoogleTpuApi sends flex-start over REST: the proto would reject (not silently drop) them.
    body = build_request(props(provisioning="flex-start", max_run_seconds=3600), "us-east5-b")
    from google.protobuf.json_format import ParseError

    with pytest.raises(ParseError):
        tpu_v2alpha1.QueuedResource.from_json(json.dumps(body))


@pytest.mark.parametrize("name", [p.stem for p in PAYLOADS.glob("*.json") if not p.stem.startswith(("error", "node"))])
def test_recorded_payloads_match_the_v2alpha1_schema(name):
    tpu_v2alpha1.QueuedResource.from_json(json.dumps(payload(name, "us-east5-b")))


def test_node_payload_matches_the_v2alpha1_schema():
    tpu_v2alpha1.Node.from_json(json.dumps(payload("node_ready", "us-east5-b")))


# --- states ---------------------------------------------------------------------------------------


def test_waits_for_active_and_reports_progress():
    api = ReplayTpuApi({"us-east5-b": ["waiting_for_resources", "waiting_for_resources", "provisioning", "active"]})
    messages: list[str] = []
    result = provider(api, messages).create(props())
    assert result.id == f"projects/{PROJECT}/locations/us-east5-b/queuedResources/gs-tpu-v6e4-tpu-qr"
    assert (result.outs["zone"], result.outs["state"], result.outs["internal_ip"]) == (
        "us-east5-b",
        "ACTIVE",
        "10.42.0.7",
    )
    assert result.outs["external_ip"] is None
    states = [m.split(": ")[1].split(" after")[0] for m in messages if " after " in m]
    assert states == ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]
    assert [c for c in api.calls if c[0] == "delete"] == []


@pytest.mark.parametrize(
    "state_payload, state, reason",
    [
        ("failed_quota", "FAILED", "Quota limit 'TPUV6EPerProjectPerZoneForTPUAPI' has been exceeded"),
        ("suspended", "SUSPENDED", "initiated by SERVICE"),
    ],
)
def test_failed_or_suspended_fails_with_state_and_reason_and_is_deleted(state_payload, state, reason):
    api = ReplayTpuApi({"us-east5-b": ["waiting_for_resources", state_payload]})
    with pytest.raises(QueuedResourceFailed) as caught:
        provider(api).create(props())
    assert caught.value.state == state
    assert state in str(caught.value) and reason in str(caught.value)
    assert api.deleted == [f"projects/{PROJECT}/locations/us-east5-b/queuedResources/gs-tpu-v6e4-tpu-qr"]
    # A non-capacity failure is not retried in the next zone.
    assert [c[1] for c in api.calls if c[0] == "create"] == ["us-east5-b"]


def test_zone_fallback_when_create_says_no_capacity():
    api = ReplayTpuApi(
        {"us-east5-a": ["provisioning", "active"]}, create_errors={"us-east5-b": "error_resource_exhausted"}
    )
    messages: list[str] = []
    result = provider(api, messages).create(props())
    assert result.outs["zone"] == "us-east5-a"
    assert [c[1] for c in api.calls if c[0] == "create"] == ["us-east5-b", "us-east5-a"]
    assert any("no capacity in us-east5-b" in m for m in messages)
    # The second zone's request uses that zone's parent.
    assert api.calls[1][3]["tpu"]["nodeSpec"][0]["parent"].endswith("/us-east5-a")


def test_zone_fallback_when_the_queue_fails_for_capacity_deletes_first():
    api = ReplayTpuApi({"us-east5-b": ["waiting_for_resources", "failed_capacity"], "us-east5-a": ["active"]})
    result = provider(api).create(props())
    assert result.outs["zone"] == "us-east5-a"
    assert api.deleted == [f"projects/{PROJECT}/locations/us-east5-b/queuedResources/gs-tpu-v6e4-tpu-qr"]
    order = [c[:2] for c in api.calls if c[0] in ("create", "delete")]
    assert order == [("create", "us-east5-b"), ("delete", "us-east5-b"), ("create", "us-east5-a")]


def test_no_capacity_anywhere_names_every_zone():
    api = ReplayTpuApi({}, create_errors={z: "error_resource_exhausted" for z in ZONES})
    with pytest.raises(QueuedResourceFailed) as caught:
        provider(api).create(props())
    assert all(zone in str(caught.value) for zone in ZONES)


def test_other_errors_do_not_fall_back():
    api = ReplayTpuApi({"us-east5-a": ["active"]}, create_errors={"us-east5-b": "error_permission_denied"})
    with pytest.raises(QueuedResourceFailed, match="PERMISSION_DENIED"):
        provider(api).create(props())
    assert [c[1] for c in api.calls if c[0] == "create"] == ["us-east5-b"]


def test_timeout_fails_and_deletes():
    ticks = iter(range(0, 100000, 1000))
    api = ReplayTpuApi({"us-east5-b": ["waiting_for_resources"]})
    with pytest.raises(QueuedResourceFailed, match="not ACTIVE within 3600 s"):
        provider(api, clock=lambda: next(ticks)).create(props())
    assert len(api.deleted) == 1


def test_capacity_classification():
    assert is_capacity_error("RESOURCE_EXHAUSTED", "")
    assert is_capacity_error("FAILED", payload("failed_capacity", "z")["state"]["failedData"]["error"]["message"])
    assert not is_capacity_error("PERMISSION_DENIED", "Permission 'tpu.queuedResources.create' denied")


def test_read_reports_state_and_gone():
    api = ReplayTpuApi({"us-east5-b": ["suspended"]})
    name = f"projects/{PROJECT}/locations/us-east5-b/queuedResources/gs-tpu-v6e4-tpu-qr"
    assert provider(api).read(name, props()).outs["state"] == "SUSPENDED"
    gone = f"projects/{PROJECT}/locations/us-east1-d/queuedResources/gs-tpu-v6e4-tpu-qr"
    assert provider(api).read(gone, props()).id == ""


def test_delete_forwards_and_tolerates_already_gone():
    api = ReplayTpuApi({})
    provider(api).delete("projects/p/locations/us-east5-b/queuedResources/q", props())
    assert api.deleted == ["projects/p/locations/us-east5-b/queuedResources/q"]


def test_diff_replaces_on_request_changes_only():
    p = provider(ReplayTpuApi({}))
    changed = p.diff("id", props(), props(accelerator_type="v6e-8"))
    assert changed.changes and changed.replaces == ["accelerator_type"] and changed.delete_before_replace
    assert not p.diff("id", props(), props(wait_timeout_seconds=10)).changes


def test_module_import_does_not_load_the_google_client():
    code = (
        f"import sys; sys.path.insert(0, {str(INFRA)!r}); import tpu_queued_resource; "
        "print(any(m.startswith('google.cloud.tpu') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
