"""`gemmaserve:cloud` validation: every bad value names the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from gemmaserve.cloud.config import parse_cloud, settings_from_config
from gemmaserve.sources import read_stack_config
from gemmaserve.spec import SpecError
from tests.infra.conftest import PROJECT, ROOT, STACKS

OK = {"zones": ["us-east5-b"]}


@pytest.mark.parametrize("stack", STACKS)
def test_every_stack_file_validates(stack):
    raw = read_stack_config(stack, ROOT)
    settings = settings_from_config(raw, {"project": PROJECT, "region": None}, stack)
    assert settings.cloud.zones


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"zones": []}, "cloud.zones = []"),
        ({"zones": ["us-east5"]}, "'us-east5' not a zone; allowed: zone names such as us-east5-b"),
        ({"provisioning": "preemptible"}, "cloud.provisioning = 'preemptible': Input should be 'standard'"),
        ({"provisioning": "flex-start"}, "cloud.max_run_duration = None: flex-start needs one"),
        (
            {"provisioning": "flex-start", "max_run_duration": "8d"},
            "cloud.max_run_duration = '8d': flex-start allows at most 7d",
        ),
        (
            {"provisioning": "flex-start", "max_run_duration": "1d", "termination_action": "STOP"},
            "cloud.termination_action = 'STOP': flex-start capacity is returned; allowed: DELETE",
        ),
        (
            {"provisioning": "flex-start", "max_run_duration": "5m"},
            "cloud.max_run_duration = '5m': flex-start runs at least 10 minutes; allowed: 10m to 7d",
        ),
        ({"max_run_duration": "a week"}, "cloud.max_run_duration = 'a week': not a duration"),
        ({"provisioning": "reserved"}, "cloud.reservation = None: provisioning 'reserved' needs a reservation name"),
        ({"reservation": "pool"}, "cloud.reservation = 'pool': only with provisioning: reserved"),
        ({"provisioning": "guaranteed", "max_run_duration": "1d"}, "guaranteed capacity has no run limit"),
        ({"serving_port_cidrs": ["0.0.0.0/0"]}, "0.0.0.0/0 opens the serving port to the internet"),
        ({"serving_port_cidrs": ["10.0.0.0/33"]}, "'10.0.0.0/33' is not a CIDR"),
        ({"valid_after": "2026-02-01T08:00:00"}, "needs a time zone"),
        ({"labels": {"Team": "x"}}, "Team='x': allowed: lowercase keys/values"),
        ({"network": {"cidr": "8.8.0.0/16"}}, "allowed: a private (RFC 1918) range"),
        ({"secret_replication": ["mars"]}, "allowed: 'automatic' or a non-empty list of regions"),
        ({"max_run_duraton": "1d"}, "cloud.max_run_duraton: unknown field"),
        ({"hosts": 0}, "cloud.hosts = 0"),
    ],
)
def test_bad_values_are_named(changes, expected):
    with pytest.raises(SpecError) as caught:
        parse_cloud({**OK, **changes})
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    "cidrs",
    [["0.0.0.0/1", "128.0.0.0/1"], ["0.0.0.0/2", "64.0.0.0/2", "128.0.0.0/1"], ["8.0.0.0/5"], ["2000::/3"], ["::/1"]],
)
def test_ranges_that_add_up_to_the_internet_need_the_opt_in_too(cidrs):
    with pytest.raises(SpecError, match="opens the serving port to the internet"):
        parse_cloud({**OK, "serving_port_cidrs": cidrs})
    assert parse_cloud({**OK, "serving_port_cidrs": cidrs, "allow_public_serving": True})


def test_public_serving_needs_explicit_opt_in():
    assert parse_cloud({**OK, "serving_port_cidrs": ["0.0.0.0/0"], "allow_public_serving": True})


def test_safe_defaults():
    cloud = parse_cloud(OK)
    assert cloud.allow_external_ip is False and cloud.protect is True and cloud.serving_port_cidrs == ()
    assert cloud.provisioning == "standard" and cloud.secret_replication == "automatic"


def test_cloud_must_be_a_mapping():
    with pytest.raises(SpecError, match="must be a mapping with at least `zones`"):
        parse_cloud(None)


SERVING = {"api_keys": {"secret_manager": "x-api-keys"}, "tls": {"secret_manager": "x-tls"}}


def spec_raw(kind: str, count: int, model: str = "e2b", **cloud) -> dict:
    return {
        "model": model,
        "accelerator": {"kind": kind, "count": count},
        "serving": SERVING,
        "cloud": {**OK, **cloud},
    }


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            spec_raw("a100-80gb", 1, provisioning="guaranteed"),
            "cloud.provisioning = 'guaranteed': a TPU queued-resource tier; allowed for GPU VMs",
        ),
        (spec_raw("a100-80gb", 1, valid_until="1h"), "TPU queueing policy only"),
        (spec_raw("tpu-v6e", 4, hosts=2), "cloud.hosts = 2: a TPU stack is one queued slice"),
        (spec_raw("mi300x", 8), "'mi300x': not sold on Google Cloud"),
        (spec_raw("tpu-v7", 8, zones=["us-central1-a"]) | {"cloud": {"zones": ["bad"]}}, "not a zone"),
    ],
)
def test_cross_checks_with_the_spec(raw, expected):
    with pytest.raises(SpecError) as caught:
        settings_from_config(raw, {"project": PROJECT, "region": "us-east5"}, "x")
    assert expected in str(caught.value)


@pytest.mark.parametrize("field", ["api_keys", "tls"])
def test_stack_hosts_read_keys_and_certificate_from_secret_manager(field):
    raw = spec_raw("l4", 1, zones=["us-east5-a"])
    raw["serving"] = {**SERVING, field: {"file": "/etc/gemmaserve/x"}}
    with pytest.raises(SpecError) as caught:
        settings_from_config(raw, {"project": PROJECT, "region": "us-east5"}, "x")
    assert f"serving.{field}.file = '/etc/gemmaserve/x'" in str(caught.value)
    assert f"allowed: serving.{field}.secret_manager" in str(caught.value)


def test_gpu_zones_must_match_the_region():
    raw = spec_raw("l4", 1, zones=["europe-west4-a"])
    with pytest.raises(SpecError, match="GPU hosts must be in gcp:region us-east5"):
        settings_from_config(raw, {"project": PROJECT, "region": "us-east5"}, "x")


def test_tpu_zones_may_span_regions():
    raw = spec_raw("tpu-v6e", 4, zones=["us-east5-b", "europe-west4-a"])
    settings = settings_from_config(raw, {"project": PROJECT, "region": "us-east5"}, "x")
    assert settings.cloud.regions == ("us-east5", "europe-west4")
    assert settings.tpu_type.accelerator_type == "v6e-4"


# --- issue 12, defect 11: what Google sells where --------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            spec_raw(
                "tpu-v6e", 4, provisioning="flex-start", max_run_duration="1d", zones=["us-east5-b", "us-east5-a"]
            ),
            "cloud.zones = ['us-east5-b']: flex-start tpu-v6e is not sold there and every zone must sell it;"
            " allowed: asia-northeast1-b, us-east5-a",
        ),
        (
            spec_raw("tpu-v6e", 4, fallback_provisioning=["flex-start"], max_run_duration="1d", zones=["us-east1-d"]),
            "flex-start tpu-v6e is not sold there and at least one zone must sell it",
        ),
        (
            spec_raw("tpu-v7", 4, provisioning="flex-start", max_run_duration="1d", zones=["us-central1-a"]),
            "allowed: none (no flex-start for tpu-v7)",
        ),
        (
            spec_raw(
                "rtx-pro-6000",
                8,
                model="31b",
                provisioning="flex-start",
                max_run_duration="1d",
                boot_disk_type="hyperdisk-balanced",
                weights_disk={"type": "hyperdisk-balanced"},
                zones=["us-east5-b"],
            ),
            "cloud.provisioning = 'flex-start': g4-standard-384 (G4) is not sold as flex-start",
        ),
        (
            spec_raw("rtx-pro-6000", 8, model="31b", zones=["us-east5-b"]),
            "cloud.boot_disk_type = 'pd-balanced': G4 attaches Hyperdisk only; allowed: hyperdisk-balanced",
        ),
        (
            spec_raw(
                "rtx-pro-6000",
                8,
                model="31b",
                boot_disk_type="hyperdisk-balanced",
                zones=["us-east5-b"],
                weights_disk={"type": "pd-ssd"},
            ),
            "cloud.weights_disk.type = 'pd-ssd': G4 attaches Hyperdisk only",
        ),
        (
            spec_raw("tpu-v7", 4, zones=["us-central1-c"]),
            "accelerator.kind = 'tpu-v7': Ironwood (TPU7x) is offered through GKE and Compute Engine TPU machine types,"
            " not as the Cloud TPU queued resources this program requests; allowed: tpu-v5e, tpu-v6e"
            " (https://cloud.google.com/tpu/docs/tpu7x)",
        ),
        (
            spec_raw("tpu-v7", 8, zones=["us-central1-c"]),
            "count 8 is not a valid tpu-v7 host size (a slice of 8 chips spans 2 VMs of 4 chips each); allowed: 4",
        ),
        (
            spec_raw("tpu-v6e", 4, weights_disk={"type": "pd-balanced"}),
            "cloud.weights_disk.type = 'pd-balanced': a tpu-v6e VM attaches hyperdisk-balanced as its data disk;"
            " allowed: hyperdisk-balanced, none",
        ),
        (
            spec_raw("tpu-v6e", 4, weights_disk={"type": "local-ssd"}),
            "cloud.weights_disk.type = 'local-ssd': a tpu-v6e VM attaches hyperdisk-balanced",
        ),
        (
            spec_raw("a100-80gb", 1, zones=["us-east5-b"], fallback_provisioning=["spot"]),
            "cloud.fallback_provisioning = ['spot']: a TPU queue fallback",
        ),
    ],
)
def test_what_google_sells_where(raw, expected):
    with pytest.raises(SpecError) as caught:
        settings_from_config(raw, {"project": PROJECT, "region": "us-east5"}, "x")
    assert expected in str(caught.value)


def test_flex_start_fallback_is_asked_for_only_where_it_is_sold():
    raw = spec_raw(
        "tpu-v6e", 4, fallback_provisioning=["flex-start"], max_run_duration="1d", zones=["us-east5-b", "us-east5-a"]
    )
    settings = settings_from_config(raw, {"project": PROJECT, "region": "us-east5"}, "x")
    assert settings.flex_start_zones == ("us-east5-a",)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"fallback_provisioning": ["flex-start"]}, "cloud.max_run_duration = None: flex-start needs one"),
        ({"fallback_provisioning": ["spot", "spot"]}, "a model is listed twice"),
        ({"fallback_provisioning": ["reserved"]}, "cloud.reservation = None: provisioning 'reserved' needs"),
        (
            {"provisioning": "reserved", "reservation": "projects/p/locations/us-east1-d/reservations/pool"},
            "with ZONE in cloud.zones",
        ),
        ({"create_wait": "soon"}, "cloud.create_wait = 'soon': not a duration"),
        ({"fallback_provisioning": ["preemptible"]}, "cloud.fallback_provisioning.0 = 'preemptible'"),
    ],
)
def test_chain_values_are_named(changes, expected):
    with pytest.raises(SpecError) as caught:
        parse_cloud({**OK, **changes})
    assert expected in str(caught.value)


def test_reserved_then_spot_then_flex_start_is_a_valid_chain():
    cloud = parse_cloud(
        {
            "zones": ["us-east5-a", "us-east5-b"],
            "provisioning": "reserved",
            "reservation": "projects/p/locations/us-east5-a/reservations/pool",
            "fallback_provisioning": ["spot", "flex-start"],
            "max_run_duration": "7d",
        }
    )
    assert cloud.provisioning_chain == ("reserved", "spot", "flex-start")


# --- issue 12 x issue 15: a bucket name exists once, so only one stack may create it ---------------


def _write_stack(directory, stack: str, weights: dict, cloud: dict) -> None:
    import yaml

    config = {f"gemmaserve:{k}": v for k, v in read_stack_config("gpu8", ROOT).items()}
    config["gemmaserve:weights"] = weights
    config["gemmaserve:cloud"] = {**config["gemmaserve:cloud"], **cloud}
    (directory / f"Pulumi.{stack}.yaml").write_text(yaml.safe_dump({"config": config}))


BUCKET_WEIGHTS = {"source": "bucket", "bucket": "gs://team-weights/gemma", "revision": "0" * 40}


def test_two_stacks_creating_one_bucket_are_refused_naming_both(tmp_path):
    _write_stack(tmp_path, "gpu8-eu", BUCKET_WEIGHTS, {})
    _write_stack(tmp_path, "gpu8-us", {**BUCKET_WEIGHTS, "bucket": "gs://team-weights"}, {})
    raw = read_stack_config("gpu8-us", tmp_path)
    with pytest.raises(SpecError) as error:
        settings_from_config(raw, {"project": PROJECT, "region": None}, "gpu8-us", project_dir=tmp_path)
    assert "weights.bucket = gs://team-weights: stack(s) gpu8-eu create it too" in str(error.value)
    assert "cloud.weights_bucket.create: false" in str(error.value)


def test_one_stack_creates_the_bucket_the_others_use(tmp_path):
    _write_stack(tmp_path, "gpu8-eu", BUCKET_WEIGHTS, {})
    _write_stack(tmp_path, "gpu8-us", BUCKET_WEIGHTS, {"weights_bucket": {"create": False}})
    _write_stack(tmp_path, "gpu8-hub", {"source": "hub"}, {})
    for stack in ("gpu8-eu", "gpu8-us", "gpu8-hub"):
        raw = read_stack_config(stack, tmp_path)
        settings_from_config(raw, {"project": PROJECT, "region": None}, stack, project_dir=tmp_path)


def test_the_program_reads_the_other_stack_files_beside_pulumi_yaml(monkeypatch):
    from gemmaserve.cloud import config as cloud_config
    from tests.infra.conftest import run_program

    seen, real = [], cloud_config.settings_from_config
    monkeypatch.setattr(
        cloud_config, "settings_from_config", lambda *a, **k: seen.append(k["project_dir"]) or real(*a, **k)
    )
    run_program("gpu8")
    assert seen == [ROOT] and (ROOT / "Pulumi.yaml").is_file()
