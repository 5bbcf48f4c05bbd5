"""GoogleTpuApi (google-api-python-client's discovery client) against the fake TPU API served over HTTP."""

from __future__ import annotations

import pytest
from google.auth.credentials import AnonymousCredentials

from gemmaserve.cloud.tpu_api import ApiError, GoogleTpuApi
from gemmaserve.cloud.tpu_queued_resource import QueuedResourceProvider, build_request
from tests.infra.fake_tpu import FakeTpu, Zone, recorded_error, serve_http
from tests.infra.test_tpu_queued_resource import PROJECT, QR_ID, ZONES, props, qr_name


@pytest.fixture
def served():
    fake = FakeTpu()
    server = serve_http(fake)
    api = GoogleTpuApi(
        credentials=AnonymousCredentials(),
        endpoint=f"http://127.0.0.1:{server.server_address[1]}/",
        sleep=fake.clock.sleep,
        clock=fake.clock,
    )
    yield fake, api
    server.shutdown()


def test_lifecycle_over_rest(served):
    fake, api = served
    fake.zones[ZONES[0]] = Zone(capacity_at=fake.clock())
    provider = QueuedResourceProvider(
        api_factory=lambda: api, poll_seconds=30, sleep=fake.clock.sleep, clock=fake.clock, progress=lambda _: None
    )
    result = provider.create(props())
    assert (result.outs["state"], result.outs["internal_ip"]) == ("ACTIVE", "10.42.0.7")
    update = provider.update(result.id, result.outs, props(labels={"app": "gemmaserve", "team": "a"}))
    assert update.outs["labels"] == {"app": "gemmaserve", "team": "a"}
    assert fake.get_node(result.outs["node_name"])["labels"]["team"] == "a"
    provider.delete(result.id, update.outs)
    assert fake.live() == []
    assert [c[0] for c in fake.calls if c[0] in ("create", "patch_node", "delete")] == [
        "create",
        "patch_node",
        "delete",
    ]


def test_refusals_arrive_as_api_errors_with_their_status(served):
    fake, api = served
    fake.zones[ZONES[0]] = Zone(refuse_create=recorded_error("error_permission_denied", ZONES[0]))
    with pytest.raises(ApiError) as caught:
        api.create_queued_resource(f"projects/{PROJECT}/locations/{ZONES[0]}", QR_ID, build_request(props(), ZONES[0]))
    assert (caught.value.code, caught.value.status) == (403, "PERMISSION_DENIED")
    with pytest.raises(ApiError) as missing:
        api.get_queued_resource(qr_name(ZONES[1]))
    assert missing.value.status == "NOT_FOUND"


def test_a_body_the_discovery_document_refuses_is_invalid_argument(served):
    _, api = served
    body = build_request(props(), ZONES[0])
    body["tpu"]["nodeSpec"][0]["node"]["acceleratorTyp"] = "v6e-4"
    with pytest.raises(ApiError) as caught:
        api.create_queued_resource(f"projects/{PROJECT}/locations/{ZONES[0]}", QR_ID, body)
    assert caught.value.status == "INVALID_ARGUMENT" and "acceleratorTyp: unknown field" in caught.value.message


def provider_over(fake: FakeTpu, api: GoogleTpuApi) -> QueuedResourceProvider:
    return QueuedResourceProvider(
        api_factory=lambda: api, poll_seconds=30, sleep=fake.clock.sleep, clock=fake.clock, progress=lambda _: None
    )


def test_a_quota_refusal_arrives_with_its_details_and_stops_the_chain(served):
    from gemmaserve.cloud.tpu_queued_resource import QueuedResourceFailed
    from tests.infra.test_tpu_queued_resource import QUOTA_FAILURE

    fake, api = served
    for zone in ZONES:
        fake.zones[zone] = Zone(
            refuse_create=ApiError(429, "RESOURCE_EXHAUSTED", "Resource exhausted", [QUOTA_FAILURE])
        )
    with pytest.raises(QueuedResourceFailed) as caught:
        provider_over(fake, api).create(props())
    assert caught.value.state == "QUOTA" and "TPUV6EPerProjectPerZoneForTPUAPI" in caught.value.reason
    assert fake.created_in() == [ZONES[0]]


def test_a_create_whose_operation_never_finishes_is_adopted(served):
    fake, api = served
    api.operation_timeout = 60
    fake.create_operations_finish = False
    fake.zones[ZONES[0]] = Zone(capacity_at=fake.clock() + 3 * 3600)
    result = provider_over(fake, api).create(props())
    assert result.outs["zone"] == ZONES[0] and result.outs["state"] == "WAITING_FOR_RESOURCES"
    assert [r.name for r in fake.live()] == [qr_name(ZONES[0])]


def test_the_data_disk_over_rest_is_a_compute_disk_attached_and_deleted_with_the_request(served):
    from tests.infra.test_tpu_queued_resource import DATA_DISK, disk_path

    fake, api = served
    fake.zones[ZONES[0]] = Zone(capacity_at=fake.clock())
    provider = provider_over(fake, api)
    result = provider.create(props(data_disk=DATA_DISK))
    assert result.outs["state"] == "ACTIVE"
    disk = api.get_disk(PROJECT, ZONES[0], "gs-tpu-v6e4-tpu-qr-node-data")
    assert (disk["sizeGb"], disk["type"].rsplit("/", 1)[-1]) == ("130", "hyperdisk-balanced")
    assert fake.get_node(result.outs["node_name"])["dataDisks"][0]["sourceDisk"] == disk_path(ZONES[0])
    provider.delete(result.id, result.outs)
    assert fake.disks == {}
    with pytest.raises(ApiError) as gone:
        api.get_disk(PROJECT, ZONES[0], "gs-tpu-v6e4-tpu-qr-node-data")
    assert gone.value.status == "NOT_FOUND"


def test_service_disabled_arrives_with_its_error_info_and_is_waited_out(served):
    from gemmaserve.cloud.tpu_queued_resource import classify

    fake, api = served
    fake.disabled_calls = 1
    with pytest.raises(ApiError) as caught:
        api.get_queued_resource(qr_name(ZONES[0]))
    assert (caught.value.code, classify(caught.value)) == (403, "disabled")
    fake.disabled_calls = 4
    fake.zones[ZONES[0]] = Zone(capacity_at=fake.clock())
    assert provider_over(fake, api).create(props()).outs["state"] == "ACTIVE"
