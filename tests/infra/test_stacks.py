"""Every stack under Pulumi's mocks (preview=False): the resources declared, their key properties, the outputs."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from gemmaserve.plan import plan
from gemmaserve.sources import load_stack_spec, stack_host_data, stack_prefix
from gemmaserve.spec import SpecError
from tests.infra.compute_facts import read_back_scratch_disks
from tests.infra.conftest import (
    HF_TOKEN,
    PROJECT,
    ROOT,
    STACKS,
    CloudMocks,
    ProgramRun,
    run_program,
    stack_config,
)
from tests.infra.discovery import COMPUTE, Discovery

INSTANCE = "gcp:compute/instance:Instance"
FIREWALL = "gcp:compute/firewall:Firewall"
QUEUED = "pulumi-python:dynamic:Resource"
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"

# The shared base every stack declares: APIs, network, identity, secret, image.
BASE = {
    "gcp:projects/service:Service": 6,
    "gcp:compute/network:Network": 1,
    "gcp:compute/firewall:Firewall": 2,  # SSH from IAP, serving port from serving_port_cidrs
    "gcp:serviceaccount/account:Account": 1,
    "gcp:projects/iAMMember:IAMMember": 2,
    # The HF token, the API keys and the TLS certificate; versions: the token and the certificate (keys
    # get theirs from `gemmaserve keys`).
    "gcp:secretmanager/secret:Secret": 3,
    "gcp:secretmanager/secretVersion:SecretVersion": 2,
    "gcp:secretmanager/secretIamMember:SecretIamMember": 3,
    # The stack's CA and the hosts' certificate.
    "tls:index/privateKey:PrivateKey": 2,
    "tls:index/selfSignedCert:SelfSignedCert": 1,
    "tls:index/certRequest:CertRequest": 1,
    "tls:index/locallySignedCert:LocallySignedCert": 1,
    "gcp:artifactregistry/repository:Repository": 1,
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember": 1,
}
WAIT = "pulumi-python:dynamic/gemmaserve:EnablementWait"
BASE[WAIT] = 1  # the wait after the APIs are enabled (issue 25 finding 6)
# Written out, not derived from the catalog: a wrong catalog entry or lookup must fail here.
TPU_EXTRA = {"gcp:projects/service:Service": 1, "gcp:projects/serviceIdentity:ServiceIdentity": 1}
EXPECTED = {
    "tpu-v6e4": {"regions": 2, QUEUED: 1, **TPU_EXTRA},
    "tpu-v6e1": {"regions": 1, QUEUED: 1, **TPU_EXTRA},
    "gpu8": {"regions": 1, INSTANCE: 1, "gcp:compute/disk:Disk": 1},
    "a100": {"regions": 1, INSTANCE: 1, "gcp:compute/disk:Disk": 1},
    "h100": {"regions": 1, INSTANCE: 1, "gcp:compute/disk:Disk": 1},
}
MACHINE_TYPES = {"gpu8": "g4-standard-384", "a100": "a2-ultragpu-1g", "h100": "a3-highgpu-8g"}
TPU_TYPES = {"tpu-v6e4": ("v6e-4", "v2-alpha-tpuv6e"), "tpu-v6e1": ("v6e-1", "v2-alpha-tpuv6e")}
GPU_STACKS = tuple(MACHINE_TYPES)
TPU_STACKS = tuple(TPU_TYPES)
HOST_KEYS = {
    "name",
    "internal_ip",
    "external_ip",
    "zone",
    "ssh_user",
    "kind",
    "instance_type",
    "provisioning",
    "accelerator",
    "router_port",
    "replicas",
}


def expected_counts(stack: str) -> Counter:
    extra = dict(EXPECTED[stack])
    regions = extra.pop("regions")
    per_region = {
        "gcp:compute/subnetwork:Subnetwork": regions,
        "gcp:compute/router:Router": regions,
        "gcp:compute/routerNat:RouterNat": regions,
    }
    return Counter(BASE) + Counter(per_region) + Counter(extra)


def with_cloud(stack: str, **changes) -> dict:
    config = stack_config(stack)
    config["gemmaserve:cloud"] = {**config["gemmaserve:cloud"], **changes}
    return config


@pytest.mark.parametrize("stack", STACKS)
def test_resource_set(stack_runs, stack):
    assert Counter(stack_runs[stack].types) == expected_counts(stack)


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_machine_type(stack_runs, stack):
    assert stack_runs[stack].one(INSTANCE).inputs["machineType"] == MACHINE_TYPES[stack]


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_no_guest_accelerators_on_machine_types_that_bundle_gpus(stack_runs, stack):
    # a2/a3/g4 carry their GPUs; declaring guest_accelerators on them is refused by the API.
    assert not stack_runs[stack].one(INSTANCE).inputs.get("guestAccelerators")


@pytest.mark.parametrize("stack", TPU_STACKS)
def test_tpu_accelerator_and_runtime(stack_runs, stack):
    props = stack_runs[stack].one(QUEUED).inputs
    assert (props["accelerator_type"], props["runtime_version"]) == TPU_TYPES[stack]


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_gpu_hosts_have_no_external_ip(stack_runs, stack):
    nics = stack_runs[stack].one(INSTANCE).inputs["networkInterfaces"]
    assert len(nics) == 1 and not nics[0].get("accessConfigs")


@pytest.mark.parametrize("stack", TPU_STACKS)
def test_tpu_hosts_have_no_external_ip(stack_runs, stack):
    assert stack_runs[stack].one(QUEUED).inputs["enable_external_ips"] is False


def test_allow_external_ip_is_visible_to_these_tests():
    # The check above must be able to fail: opting in declares an access config.
    run = run_program("a100", with_cloud("a100", allow_external_ip=True))
    assert run.one(INSTANCE).inputs["networkInterfaces"][0]["accessConfigs"] == [{}]
    assert run.outputs["hosts"][0]["external_ip"] == "34.1.2.3"


@pytest.mark.parametrize("stack", STACKS)
def test_no_firewall_opens_to_the_world(stack_runs, stack):
    rules = stack_runs[stack].of_type(FIREWALL)
    assert rules
    for rule in rules:
        assert "0.0.0.0/0" not in rule.inputs.get("sourceRanges", []), rule.name


@pytest.mark.parametrize("stack", STACKS)
def test_ssh_only_from_iap_and_serving_only_from_configured_ranges(stack_runs, stack):
    rules = {tuple(a["ports"] for a in r.inputs["allows"])[0][0]: r.inputs for r in stack_runs[stack].of_type(FIREWALL)}
    assert rules["22"]["sourceRanges"] == ["35.235.240.0/20"]
    assert rules["8080"]["sourceRanges"] == ["10.0.0.0/8"]
    assert all(r["targetTags"] == ["gemmaserve-host"] for r in rules.values())


def test_subnets_have_private_google_access_and_nat(stack_runs):
    run = stack_runs["tpu-v6e4"]
    subnets = run.of_type("gcp:compute/subnetwork:Subnetwork")
    assert {s.inputs["region"] for s in subnets} == {"us-east5", "us-east1"}
    assert all(s.inputs["privateIpGoogleAccess"] is True for s in subnets)
    nats = run.of_type("gcp:compute/routerNat:RouterNat")
    assert {n.inputs["region"] for n in nats} == {"us-east5", "us-east1"}
    for nat in nats:
        assert nat.inputs["sourceSubnetworkIpRangesToNat"] == "ALL_SUBNETWORKS_ALL_IP_RANGES"


@pytest.mark.parametrize(
    "stack, model, restart, preemptible, action, reservation",
    [
        ("gpu8", "STANDARD", True, False, None, "ANY_RESERVATION"),
        ("a100", "SPOT", False, True, "STOP", "NO_RESERVATION"),
        ("h100", "FLEX_START", False, False, "DELETE", "NO_RESERVATION"),
    ],
)
def test_gpu_scheduling(stack_runs, stack, model, restart, preemptible, action, reservation):
    inputs = stack_runs[stack].one(INSTANCE).inputs
    scheduling = inputs["scheduling"]
    assert scheduling["onHostMaintenance"] == "TERMINATE"
    assert scheduling["provisioningModel"] == model
    assert scheduling["automaticRestart"] is restart
    assert scheduling["preemptible"] is preemptible
    assert scheduling.get("instanceTerminationAction") == action
    assert inputs["reservationAffinity"]["type"] == reservation


def test_flex_start_gpu_has_seven_day_limit(stack_runs):
    assert stack_runs["h100"].one(INSTANCE).inputs["scheduling"]["maxRunDuration"] == {"seconds": 7 * 24 * 3600}


def test_reserved_gpu_targets_the_named_reservation():
    run = run_program("gpu8", with_cloud("gpu8", provisioning="reserved", reservation="g4-pool"))
    affinity = run.one(INSTANCE).inputs["reservationAffinity"]
    assert affinity == {
        "type": "SPECIFIC_RESERVATION",
        "specificReservation": {"key": "compute.googleapis.com/reservation-name", "values": ["g4-pool"]},
    }


@pytest.mark.parametrize(
    "stack, provisioning, valid_until", [("tpu-v6e4", "guaranteed", 6 * 3600), ("tpu-v6e1", "spot", 2 * 3600)]
)
def test_tpu_provisioning_and_queue(stack_runs, stack, provisioning, valid_until):
    props = stack_runs[stack].one(QUEUED).inputs
    assert props["provisioning"] == provisioning
    assert props["valid_until_seconds"] == valid_until


def test_tpu_zones_in_order(stack_runs):
    assert stack_runs["tpu-v6e4"].one(QUEUED).inputs["zones"] == ["us-east5-b", "us-east5-a", "us-east1-d"]


@pytest.mark.parametrize("stack", TPU_STACKS)
def test_queued_resource_is_protected_by_default(stack_runs, stack):
    assert stack_runs[stack].one(QUEUED).protect is True


def test_protection_can_be_turned_off_explicitly():
    assert run_program("tpu-v6e1", with_cloud("tpu-v6e1", protect=False)).one(QUEUED).protect is False


LABELED = (
    INSTANCE,
    "gcp:compute/disk:Disk",
    "gcp:secretmanager/secret:Secret",
    "gcp:artifactregistry/repository:Repository",
)


@pytest.mark.parametrize("stack", STACKS)
def test_labels(stack_runs, stack):
    run = stack_runs[stack]
    spec = load_stack_spec(stack, ROOT)
    want = {
        "app": "gemmaserve",
        "managed-by": "pulumi",
        "stack": stack,
        "model": spec.model_info.aliases[0],
        "accelerator": spec.accelerator_info.name,
        "team": "serving",
    }
    labeled = [r for r in run.resources if r.type in LABELED] + run.of_type(QUEUED)
    assert labeled
    for resource in labeled:
        labels = resource.inputs.get("labels") or {}
        assert want.items() <= labels.items(), resource.name


@pytest.mark.parametrize("stack", STACKS)
def test_service_account_scopes_and_roles(stack_runs, stack):
    run = stack_runs[stack]
    email = run.one("gcp:serviceaccount/account:Account").inputs["accountId"] + f"@{PROJECT}.iam.gserviceaccount.com"
    member = f"serviceAccount:{email}"
    project_roles = {(m.inputs["role"], m.inputs["member"]) for m in run.of_type("gcp:projects/iAMMember:IAMMember")}
    assert project_roles == {("roles/logging.logWriter", member), ("roles/monitoring.metricWriter", member)}
    # The HF token, the API keys and the TLS certificate: each readable by the hosts' account, nothing more.
    accessors = {
        (a.inputs["role"], a.inputs["member"]) for a in run.of_type("gcp:secretmanager/secretIamMember:SecretIamMember")
    }
    assert accessors == {("roles/secretmanager.secretAccessor", member)}
    assert len(run.of_type("gcp:secretmanager/secretIamMember:SecretIamMember")) == 3
    reader = run.one("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember").inputs
    assert (reader["role"], reader["member"]) == ("roles/artifactregistry.reader", member)
    if stack in GPU_STACKS:
        account = run.one(INSTANCE).inputs["serviceAccount"]
        assert account == {"email": email, "scopes": [CLOUD_PLATFORM]}
    else:
        props = run.one(QUEUED).inputs
        assert (props["service_account"], props["scopes"]) == (email, [CLOUD_PLATFORM])


SECRET = "gcp:secretmanager/secret:Secret"
VERSION = "gcp:secretmanager/secretVersion:SecretVersion"
ACCESSOR = "gcp:secretmanager/secretIamMember:SecretIamMember"


def secret_named(run: ProgramRun, secret_id: str):
    return next(r for r in run.of_type(SECRET) if r.inputs["secretId"] == secret_id)


@pytest.mark.parametrize("stack", STACKS)
def test_hf_token_never_in_outputs(stack_runs, stack):
    run = stack_runs[stack]
    assert HF_TOKEN not in json.dumps(run.outputs, default=str)
    version = next(v for v in run.of_type(VERSION) if v.name.endswith("-hf-version"))
    assert version.secret_inputs == {"secretData"}


def test_no_token_no_version():
    run = run_program("a100", hf_token=None)
    assert [v.name for v in run.of_type(VERSION)] == ["gs-a100-access-tls-version"]
    assert run.of_type(ACCESSOR)


@pytest.mark.parametrize("stack", STACKS)
def test_api_key_secret_has_no_version_and_only_the_hosts_read_it(stack_runs, stack):
    """`gemmaserve keys add --stack` adds the versions: Pulumi owns the secret only, so nothing drifts."""
    run = stack_runs[stack]
    # The stack file says `api-keys`; the stack creates its own (issue 12: names are stack-scoped).
    secret_id = f"{stack_prefix(stack)}-api-keys"
    secret = secret_named(run, secret_id)
    assert not [v for v in run.of_type(VERSION) if "keys" in v.name]
    accessor = next(a for a in run.of_type(ACCESSOR) if a.inputs["secretId"] == secret_id)
    assert accessor.inputs["role"] == "roles/secretmanager.secretAccessor"
    assert accessor.inputs["member"].startswith("serviceAccount:")
    assert secret.inputs["labels"]["stack"] == stack
    assert run.outputs["api_key_secret"] == f"projects/123456/secrets/{secret_id}"


@pytest.mark.parametrize("stack", STACKS)
def test_tls_secret_holds_the_hosts_certificate_as_a_secret(stack_runs, stack):
    run = stack_runs[stack]
    secret_named(run, f"{stack_prefix(stack)}-tls")
    version = next(v for v in run.of_type(VERSION) if v.name.endswith("-tls-version"))
    assert version.secret_inputs == {"secretData"}
    # The bundle HAProxy reads: the host certificate, the CA, the host's private key.
    bundle = version.inputs["secretData"]["value"]  # as a secret input: {signature: ..., "value": ...}
    assert bundle.index("MOCK") < bundle.index("BEGIN PRIVATE KEY")
    assert "-hosts-cert" in bundle and "-access-ca\n" in bundle and "-hosts-key" in bundle
    csr = run.one("tls:index/certRequest:CertRequest").inputs
    assert csr["ipAddresses"] == [run.outputs["hosts"][0]["internal_ip"]]
    signed = run.one("tls:index/locallySignedCert:LocallySignedCert").inputs
    assert signed["allowedUses"] == ["digital_signature", "key_encipherment", "server_auth"]
    assert signed["validityPeriodHours"] == 8760 and signed["earlyRenewalHours"] == 720
    assert run.one("tls:index/selfSignedCert:SelfSignedCert").inputs["isCaCertificate"] is True


@pytest.mark.parametrize("stack", STACKS)
def test_ca_certificate_is_exported_and_no_private_key_is(stack_runs, stack):
    run = stack_runs[stack]
    assert run.outputs["ca_cert"].startswith("-----BEGIN CERTIFICATE-----")
    assert "PRIVATE KEY" not in json.dumps(run.outputs, default=str)


def test_a_tls_secret_owned_elsewhere_gets_no_version():
    config = stack_config("a100")
    config["gemmaserve:serving"] = {
        "api_keys": {"secret_manager": "api-keys"},
        "tls": {"secret_manager": "projects/certs-project/secrets/serving-cert"},
    }
    run = run_program("a100", config)
    assert not [v for v in run.of_type(VERSION) if v.name.endswith("-tls-version")]
    accessor = next(a for a in run.of_type(ACCESSOR) if a.inputs["secretId"] == "serving-cert")
    assert accessor.inputs["project"] == "certs-project"


def test_secret_replication_user_managed():
    run = run_program("a100", with_cloud("a100", secret_replication=["us-central1", "us-east1"]))
    secrets = run.of_type("gcp:secretmanager/secret:Secret")
    assert secrets
    for secret in secrets:
        replication = secret.inputs["replication"]
        assert replication == {"userManaged": {"replicas": [{"location": "us-central1"}, {"location": "us-east1"}]}}


@pytest.mark.parametrize("stack", STACKS)
def test_hosts_output(stack_runs, stack):
    run, serving_plan = stack_runs[stack], plan(load_stack_spec(stack, ROOT))
    hosts = run.outputs["hosts"]
    assert len(hosts) == 1
    host = hosts[0]
    assert set(host) == HOST_KEYS
    assert host["external_ip"] is None
    assert host["internal_ip"].startswith("10.42.")
    assert host["ssh_user"] == "gemmaserve"
    assert host["zone"] == stack_config(stack)["gemmaserve:cloud"]["zones"][0]
    assert host["kind"] == ("tpu-vm" if stack in TPU_STACKS else "gce-vm")
    assert host["instance_type"] == (TPU_TYPES.get(stack, (None,))[0] or MACHINE_TYPES[stack])
    assert [r["port"] for r in host["replicas"]] == [r.port for r in serving_plan.replicas]
    assert [r["devices"] for r in host["replicas"]] == [r.devices for r in serving_plan.replicas]


@pytest.mark.parametrize("stack", STACKS)
def test_endpoint_and_plan_outputs(stack_runs, stack):
    run = stack_runs[stack]
    assert run.outputs["endpoint"] == f"https://{run.outputs['hosts'][0]['internal_ip']}:8080/v1"
    assert run.outputs["plan"] == json.loads(json.dumps(plan(load_stack_spec(stack, ROOT)).to_json()))


def test_bad_cloud_config_fails_before_any_resource():
    run = ProgramRun()
    with pytest.raises(SpecError) as caught:
        run_program("gpu8", with_cloud("gpu8", serving_port_cidrs=["0.0.0.0/0"]), run=run)
    assert "cloud.serving_port_cidrs" in str(caught.value) and "allow_public_serving" in str(caught.value)
    assert run.resources == []


def test_bad_spec_and_cloud_are_reported_together_before_any_resource():
    config = with_cloud("h100", max_run_duration="8d")
    config["gemmaserve:workload"] = {**config["gemmaserve:workload"], "gpu_memory_utilization": 1.5}
    run = ProgramRun()
    with pytest.raises(SpecError) as caught:
        run_program("h100", config, run=run)
    message = str(caught.value)
    assert "workload.gpu_memory_utilization = 1.5" in message
    assert "cloud.max_run_duration = '8d': flex-start allows at most 7d" in message
    assert run.resources == []


def test_missing_project_is_named():
    config = stack_config("a100")
    del config["gcp:project"]
    with pytest.raises(SpecError, match="gcp:project = None: required"):
        run_program("a100", config)


def test_multi_host_gets_a_least_request_load_balancer():
    run = run_program("gpu8", with_cloud("gpu8", hosts=2))
    assert len(run.of_type(INSTANCE)) == 2
    backend = run.one("gcp:compute/regionBackendService:RegionBackendService").inputs
    assert backend["localityLbPolicy"] == "LEAST_REQUEST"
    assert backend["loadBalancingScheme"] == "INTERNAL_MANAGED"
    assert backend["protocol"] == "HTTPS" and backend["portName"] == "https"
    check = run.one("gcp:compute/regionHealthCheck:RegionHealthCheck").inputs["httpsHealthCheck"]
    assert (check["requestPath"], check["port"]) == ("/health", 8080)
    group = run.one("gcp:compute/instanceGroup:InstanceGroup").inputs
    assert len(group["instances"]) == 2 and group["namedPorts"] == [{"name": "https", "port": 8080}]
    proxy_subnets = [
        s
        for s in run.of_type("gcp:compute/subnetwork:Subnetwork")
        if s.inputs.get("purpose") == "REGIONAL_MANAGED_PROXY"
    ]
    assert len(proxy_subnets) == 1
    lb_rule = next(r for r in run.of_type(FIREWALL) if "35.191.0.0/16" in r.inputs["sourceRanges"])
    assert "130.211.0.0/22" in lb_rule.inputs["sourceRanges"]
    assert run.outputs["endpoint"] == "https://10.42.0.200:8080/v1"
    assert len(run.outputs["hosts"]) == 2
    # HTTPS only: a certificate the stack's CA signed for the reserved address the forwarding rule takes.
    assert not run.of_type("gcp:compute/regionTargetHttpProxy:RegionTargetHttpProxy")
    certificate = run.one("gcp:compute/regionSslCertificate:RegionSslCertificate")
    assert "privateKey" in certificate.secret_inputs
    proxy = run.one("gcp:compute/regionTargetHttpsProxy:RegionTargetHttpsProxy").inputs
    assert proxy["sslCertificates"] == [f"{certificate.name}-id"]
    address = run.one("gcp:compute/address:Address").inputs
    assert address["addressType"] == "INTERNAL"
    assert run.one("gcp:compute/forwardingRule:ForwardingRule").inputs["ipAddress"] == "10.42.0.200"
    requests = {r.name: r.inputs for r in run.of_type("tls:index/certRequest:CertRequest")}
    assert requests["gs-gpu8-lb-tls-csr"]["ipAddresses"] == ["10.42.0.200"]
    assert requests["gs-gpu8-access-hosts-csr"]["ipAddresses"] == [h["internal_ip"] for h in run.outputs["hosts"]]


def test_single_host_has_no_load_balancer(stack_runs):
    assert not stack_runs["gpu8"].of_type("gcp:compute/regionBackendService:RegionBackendService")


def test_serving_image_build_is_pinned():
    run = run_program("gpu8", with_cloud("gpu8", image={"build": True}))
    image = run.one("docker:index/image:Image").inputs
    spec = load_stack_spec("gpu8", ROOT)
    assert image["build"]["args"] == {
        "BASE_IMAGE": spec.image,
        "VLLM_PACKAGE": "vllm",
        "VLLM_VERSION": spec.vllm_version,
        "TRANSFORMERS_VERSION": spec.transformers_version,
        # The template the argv's --chat-template points at, from vLLM's repository at the pinned tag,
        # checked against the sha256 recorded for that release.
        "CHAT_TEMPLATE_URL": f"https://raw.githubusercontent.com/vllm-project/vllm/v{spec.vllm_version}/examples/tool_chat_template_gemma4.jinja",
        "CHAT_TEMPLATE_SHA256": "afdbb2abe3667ccde95cc2f86919f05370339399bab5f750950a4390523b8927",
        "CHAT_TEMPLATE_PATH": "/etc/gemmaserve/tool_chat_template_gemma4.jinja",
    }
    # The stack's own repository: two stacks in one region never share (or fight over) one.
    assert image["imageName"].startswith(f"us-central1-docker.pkg.dev/{PROJECT}/gs-gpu8/vllm-gemma4:vllm-")
    assert "@sha256:" in run.outputs["serving_image"]
    assert "ya29.fake" not in json.dumps(run.outputs)


# --- issue 12: a fresh project, several stacks in one project, flex-start VMs ---------------------

SERVICE = "gcp:projects/service:Service"
# The API each resource type is served by: the program must enable every one it uses.
API_OF_TYPE = {
    "gcp:compute/": "compute.googleapis.com",
    "gcp:serviceaccount/": "iam.googleapis.com",
    "gcp:projects/iAMMember": "cloudresourcemanager.googleapis.com",
    "gcp:secretmanager/": "secretmanager.googleapis.com",
    "gcp:artifactregistry/": "artifactregistry.googleapis.com",
    "gcp:storage/": "storage.googleapis.com",
    QUEUED: "tpu.googleapis.com",
}


@pytest.mark.parametrize("stack", STACKS)
def test_every_api_the_stack_uses_is_enabled_and_never_disabled_on_destroy(stack_runs, stack):
    run = stack_runs[stack]
    enabled = {s.inputs["service"]: s.inputs for s in run.of_type(SERVICE)}
    used = {api for r in run.resources for prefix, api in API_OF_TYPE.items() if r.type.startswith(prefix)}
    # IAP: hosts have no public IP and are reached with IAP TCP forwarding (the SSH firewall rule).
    assert used | {"iap.googleapis.com"} <= set(enabled)
    assert all(s["disableOnDestroy"] is False and s["project"] == PROJECT for s in enabled.values())


@pytest.mark.parametrize("stack", STACKS)
def test_nothing_races_the_api_enablement(stack_runs, stack):
    run = stack_runs[stack]
    services = {r.urn for r in run.of_type(SERVICE)}
    assert services
    first = {SERVICE, "gcp:projects/serviceIdentity:ServiceIdentity"}
    for resource in run.resources:
        if resource.type not in first:
            assert services <= resource.dependencies, f"{resource.type} {resource.name} does not wait for the APIs"


@pytest.mark.parametrize("stack", TPU_STACKS)
def test_the_tpu_service_agent_is_created_after_the_tpu_api(stack_runs, stack):
    run = stack_runs[stack]
    agent = run.one("gcp:projects/serviceIdentity:ServiceIdentity")
    tpu_api = next(s for s in run.of_type(SERVICE) if s.inputs["service"] == "tpu.googleapis.com")
    assert agent.inputs["service"] == "tpu.googleapis.com" and tpu_api.urn in agent.dependencies
    # The serviceusage calls behind both take projects/P/services/S (Google's discovery documents).
    for api, method, parameter in [("v1", "enable", "name"), ("v1beta1", "generateServiceIdentity", "parent")]:
        pattern = Discovery("serviceusage", api).method(f"services.{method}")["parameters"][parameter]["pattern"]
        assert re.match(pattern, f"projects/{PROJECT}/services/{agent.inputs['service']}")


def test_no_two_stacks_share_a_name_in_one_project(stack_runs):
    def names(run: ProgramRun) -> set[tuple[str, str]]:
        found = {("secret", r.inputs["secretId"]) for r in run.of_type("gcp:secretmanager/secret:Secret")}
        found |= {
            ("repository", f"{r.inputs['location']}/{r.inputs['repositoryId']}")
            for r in run.of_type("gcp:artifactregistry/repository:Repository")
        }
        found |= {("account", r.inputs["accountId"]) for r in run.of_type("gcp:serviceaccount/account:Account")}
        found |= {("queued resource", r.inputs["queued_resource_id"]) for r in run.of_type(QUEUED)}
        found |= {("bucket", r.inputs["name"]) for r in run.of_type("gcp:storage/bucket:Bucket")}
        return found

    seen: dict[tuple[str, str], str] = {}
    for stack in STACKS:
        assert names(stack_runs[stack]), f"{stack} declares no named resource"
        for name in names(stack_runs[stack]):
            assert name not in seen, f"{name} is declared by both {seen[name]} and {stack}"
            seen[name] = stack


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize(
    "resource, path",
    [
        ("hf-secret", ("gemmaserve_secret",)),
        ("access-keys", ("gemmaserve_serving", "api_keys")),
        ("access-tls", ("gemmaserve_serving", "tls")),
    ],
)
def test_hosts_fetch_the_secrets_their_stack_created(stack_runs, stack, resource, path):
    """The HF token (issue 12), the API keys and the TLS certificate (issue 17): every stack file names
    them alike (hf-token, api-keys, tls); each stack creates its own and its hosts fetch that one."""
    created = next(
        r.inputs["secretId"]
        for r in stack_runs[stack].of_type("gcp:secretmanager/secret:Secret")
        if r.name == f"{stack_prefix(stack)}-{resource}"
    )
    host_value = stack_host_data(stack, ROOT)
    for key in path:
        host_value = host_value[key]
    assert created == host_value["secret_manager"] and created.startswith(stack_prefix(stack) + "-")


def test_a_secret_owned_elsewhere_is_used_as_given():
    config = stack_config("a100")
    config["gemmaserve:secret"] = {"secret_manager": "projects/shared-secrets/secrets/hf-token"}
    run = run_program("a100", config)
    assert not [r for r in run.of_type("gcp:secretmanager/secret:Secret") if r.inputs["secretId"].endswith("hf-token")]
    accessor = next(
        r for r in run.of_type("gcp:secretmanager/secretIamMember:SecretIamMember") if r.name.endswith("-hf-accessor")
    )
    assert accessor.inputs["secretId"] == "hf-token" and accessor.inputs["project"] == "shared-secrets"


def test_flex_start_vm_create_outlasts_the_queue(stack_runs):
    h100 = stack_runs["h100"].one(INSTANCE)
    minutes = int(re.fullmatch(r"(\d+)m", h100.custom_timeouts["create"])[1])
    assert minutes >= 120  # Dynamic Workload Scheduler holds a flex-start request up to 2 h
    assert not stack_runs["gpu8"].one(INSTANCE).custom_timeouts


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_gpu_scheduling_is_a_valid_compute_v1_scheduling(stack_runs, stack):
    scheduling = dict(stack_runs[stack].one(INSTANCE).inputs["scheduling"])
    if "maxRunDuration" in scheduling:  # pulumi-gcp takes an int; the REST API an int64 string
        seconds = scheduling["maxRunDuration"]["seconds"]  # Pulumi's wire format carries numbers as doubles
        assert seconds == int(seconds)
        scheduling["maxRunDuration"] = {"seconds": str(int(seconds))}
    COMPUTE.assert_request("Scheduling", scheduling)


def test_the_compute_scheduling_check_can_fail():
    errors = COMPUTE.request_errors(
        "Scheduling", {"provisioningModel": "FLEX-START", "instanceTerminationAction": "KILL"}
    )
    assert len(errors) == 2


def test_tpu_slice_gets_the_chain_and_its_bounds(stack_runs):
    props = stack_runs["tpu-v6e4"].one(QUEUED).inputs
    assert props["fallback_provisioning"] == [] and props["create_wait_seconds"] == 600
    assert props["flex_start_zones"] == ["us-east5-a"]


def test_tpu_fallback_chain_from_config():
    config = stack_config("tpu-v6e4")
    config["gemmaserve:cloud"] = {
        **config["gemmaserve:cloud"],
        "fallback_provisioning": ["spot", "flex-start"],
        "max_run_duration": "3d",
        "create_wait": "2m",
    }
    props = run_program("tpu-v6e4", config).one(QUEUED).inputs
    assert (props["provisioning"], props["fallback_provisioning"]) == ("guaranteed", ["spot", "flex-start"])
    assert (props["max_run_seconds"], props["create_wait_seconds"]) == (3 * 86400, 120)


@pytest.mark.parametrize("stack, provisioning", [("tpu-v6e1", "spot"), ("h100", "flex-start"), ("gpu8", "standard")])
def test_hosts_say_how_they_were_bought(stack_runs, stack, provisioning):
    assert stack_runs[stack].outputs["hosts"][0]["provisioning"] == provisioning


class QueuedTpuMocks(CloudMocks):
    """The queued resource as the provider returns it after its bounded wait: still WAITING, no node yet."""

    def new_resource(self, args):
        resource_id, state = super().new_resource(args)
        if args.typ == QUEUED:
            state.update(state="WAITING_FOR_RESOURCES", internal_ip=None, external_ip=None)
        return resource_id, state


@pytest.mark.parametrize("stack", TPU_STACKS)
def test_a_slice_still_queued_after_up_declares_the_rest_without_its_address(stack):
    """`pulumi up` returns with the request WAITING (issue 12): the TLS certificate (issue 17) must not be
    asked for a null IP, the endpoint is not `https://None`, and the host record says it has no address."""
    run = run_program(stack, mocks=QueuedTpuMocks())
    assert run.outputs["hosts"][0]["internal_ip"] is None
    assert run.one("tls:index/certRequest:CertRequest").inputs.get("ipAddresses", []) == []
    assert run.outputs["endpoint"] is None


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_gpu_vm_declares_the_local_ssds_google_attaches_so_a_second_up_replaces_nothing(stack_runs, stack):
    # scratch_disk is ForceNew in terraform-provider-google (resource_compute_instance.go): a read-back
    # bundle the program does not declare replaces the VM on every later `up` (terraform-provider-google#19648).
    inputs = stack_runs[stack].one(INSTANCE).inputs
    declared = [dict(d) for d in inputs.get("scratchDisks") or []]
    as_declared = [(d.get("interface", "SCSI"), d.get("size", 375)) for d in declared]
    assert as_declared == read_back_scratch_disks(inputs["machineType"], declared)


def haproxy_seconds(value: str) -> float:
    """An HAProxy time ("1h", "30s", "500ms", "2d"; a bare number is milliseconds) in seconds."""
    number, unit = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value).groups()
    return int(number) * {"us": 1e-6, "ms": 1e-3, None: 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


@pytest.mark.parametrize("stream_timeout", [None, 7200])
def test_the_balancer_and_haproxy_take_one_stream_timeout(stream_timeout):
    # A stream HAProxy still serves must not be cut by the load balancer in front of it: the backend
    # service's timeout is the whole response time on a regional internal Application Load Balancer
    # (https://cloud.google.com/load-balancing/docs/l7-internal#timeouts_and_retries). Both come from
    # serving.stream_timeout: the HAProxy config is rendered from the plan of the very config the program ran.
    from gemmaserve.sources import spec_from_config
    from roles.router import Settings as RouterSettings
    from roles.router import haproxy_config

    config = with_cloud("gpu8", hosts=2)
    if stream_timeout:
        config["gemmaserve:serving"] = {**config.get("gemmaserve:serving", {}), "stream_timeout": stream_timeout}
    run = run_program("gpu8", config)
    backend = run.one("gcp:compute/regionBackendService:RegionBackendService").inputs
    ours = {k.removeprefix("gemmaserve:"): v for k, v in config.items() if k.startswith("gemmaserve:")}
    haproxy = haproxy_config(plan(spec_from_config(ours)).require_ok(), RouterSettings())
    defaults = haproxy.split("\ndefaults")[1].split("\n\n")[0]
    timeouts = dict(re.findall(r"^\s*timeout (client|server) (\S+)$", defaults, re.M))
    assert backend["timeoutSec"] == (stream_timeout or 3600)
    assert {k: haproxy_seconds(v) for k, v in timeouts.items()} == {"client": backend["timeoutSec"]} | {
        "server": backend["timeoutSec"]
    }


def test_the_former_haproxy_stream_timeout_setting_is_refused_naming_the_spec_field():
    from roles.router import Settings as RouterSettings

    with pytest.raises(SpecError) as caught:
        RouterSettings.from_data({"router_stream_timeout": "2h"}, "h1")
    assert "serving.stream_timeout" in caught.value.problems[0]


# Third-generation and later machine series (A3, A4, G4) take gVNIC, not VirtIO-Net
# (https://cloud.google.com/compute/docs/networking/using-gvnic); A2 and G2 take either.
NIC_TYPES = {"gpu8": "GVNIC", "h100": "GVNIC", "a100": None}


@pytest.mark.parametrize("stack", GPU_STACKS)
def test_third_generation_gpu_vms_use_gvnic(stack_runs, stack):
    nic = stack_runs[stack].one(INSTANCE).inputs["networkInterfaces"][0]
    assert nic.get("nicType") == NIC_TYPES[stack]
    if nic.get("nicType"):
        COMPUTE.assert_request("NetworkInterface", {"nicType": nic["nicType"]})


@pytest.mark.parametrize("kind", ["h200", "b200"])
def test_a3_ultra_and_a4_declare_their_32_local_ssds_and_gvnic(kind):
    # Their weights on the bundled Local SSDs (Hyperdisk-only series; standard provisioning).
    config = stack_config("h100")
    cloud = {k: v for k, v in config["gemmaserve:cloud"].items() if k != "max_run_duration"}
    config["gemmaserve:accelerator"] = {"kind": kind, "count": 8}
    config["gemmaserve:cloud"] = {
        **cloud,
        "provisioning": "standard",
        "boot_disk_type": "hyperdisk-balanced",
        "weights_disk": {"type": "local-ssd"},
    }
    inputs = run_program("h100", config).one(INSTANCE).inputs
    declared = [dict(d) for d in inputs.get("scratchDisks") or []]
    as_declared = [(d.get("interface", "SCSI"), d.get("size", 375)) for d in declared]
    assert as_declared == read_back_scratch_disks(inputs["machineType"], declared)
    assert inputs["networkInterfaces"][0]["nicType"] == "GVNIC"


@pytest.mark.parametrize("stack", TPU_STACKS)
def test_tpu_slices_get_a_hyperdisk_data_disk_sized_from_the_plan(stack_runs, stack):
    # (checkpoint + engine + caches) x margin, in 10 GB steps; v6e attaches Hyperdisk, no Persistent Disk.
    from gemmaserve.cloud.config import TPU_DISK_CACHES_GIB, TPU_DISK_ENGINE_GIB, TPU_DISK_MARGIN

    disk = stack_runs[stack].one(QUEUED).inputs["data_disk"]
    model = load_stack_spec(stack).model_info
    needed = (model.checkpoint_bytes / 2**30 + TPU_DISK_ENGINE_GIB + TPU_DISK_CACHES_GIB) * TPU_DISK_MARGIN
    assert disk["type"] == "hyperdisk-balanced"
    assert needed <= disk["size_gb"] < needed + 10


def test_a_tpu_data_disk_size_or_none_set_in_the_stack_wins():
    sized = run_program("tpu-v6e1", with_cloud("tpu-v6e1", weights_disk={"size_gb": 300}))
    assert sized.one(QUEUED).inputs["data_disk"] == {"type": "hyperdisk-balanced", "size_gb": 300}
    assert (
        run_program("tpu-v6e1", with_cloud("tpu-v6e1", weights_disk={"type": "none"}))
        .one(QUEUED)
        .inputs.get("data_disk")
        is None
    )


@pytest.mark.parametrize("stack", STACKS)
def test_nothing_is_created_before_the_wait_after_api_enablement(stack_runs, stack):
    # Enabling an API is eventually consistent: every resource outside the enablement waits for the wait,
    # which waits for every projects.Service (and the TPU service agent).
    run = stack_runs[stack]
    wait = run.one(WAIT)
    enabling = {"gcp:projects/service:Service", "gcp:projects/serviceIdentity:ServiceIdentity", WAIT}
    assert {r.urn for r in run.resources if r.type in enabling - {WAIT}} <= wait.dependencies
    early = [r.name for r in run.resources if r.type not in enabling and wait.urn not in r.dependencies]
    assert early == []


def test_the_wait_waits_on_create_and_again_only_when_an_api_is_added():
    from project_apis import ENABLEMENT_WAIT_SECONDS, EnablementWaitProvider

    slept: list[float] = []
    provider = EnablementWaitProvider(sleep=slept.append)
    apis = {"apis": ["compute.googleapis.com"], "seconds": ENABLEMENT_WAIT_SECONDS}
    provider.create(apis)
    assert slept == [ENABLEMENT_WAIT_SECONDS]
    assert provider.diff("w", apis, apis).changes is False
    more = {**apis, "apis": ["compute.googleapis.com", "tpu.googleapis.com"]}
    assert provider.diff("w", apis, more).replaces == ["apis"]
