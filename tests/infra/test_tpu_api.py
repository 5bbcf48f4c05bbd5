"""GoogleTpuApi (google-api-python-client's discovery client) against the fake TPU API served over HTTP."""

from __future__ import annotations

import pytest
from google.auth.credentials import AnonymousCredentials
from tpu_api import ApiError, GoogleTpuApi
from tpu_queued_resource import QueuedResourceProvider, build_request

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
