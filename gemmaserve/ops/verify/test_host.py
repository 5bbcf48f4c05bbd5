"""Is this host serving what its plan says? One fact per test; expectations from the plan.

gemmaserve verify --inventory hosts/gpu8.py
pytest tests/verify --inventory hosts/sandbox.py
"""

from __future__ import annotations

import json
import re

import pytest
from packaging.version import Version
from prometheus_client.parser import text_string_to_metric_families

from gemmaserve.ops.endpoint import API_KEY_ENV, CITY_SCHEMA, WEATHER_TOOL, EndpointError, request, schema_problems
from gemmaserve.ops.verify.processes import server_pid

ALERT_METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running")


# --- the accelerator, where there is one ---------------------------------------------------------


def test_accelerator_visible(target):
    acc, count = target.plan.accelerator, target.plan.spec.accelerator.count
    if acc.vendor == "nvidia":
        found = len(target.host.run("nvidia-smi -L").stdout.strip().splitlines())
        version = target.host.run("nvidia-smi --query-gpu=driver_version --format=csv,noheader").stdout.split()[0]
        # The branch the nvidia role installed: its host-data key, else the role's default.
        from roles.nvidia import Settings as NvidiaSettings

        branch = NvidiaSettings.from_data(target.data, target.name).driver_branch
        assert Version(version).major == branch, version
    elif acc.vendor == "amd":
        found = len(re.findall(r"^GPU\[\d+\]", target.host.run("rocm-smi --showid").stdout, re.M)) or len(
            target.host.run("ls -d /sys/class/kfd/kfd/topology/nodes/*/gpu_id").stdout.split()
        )
    elif acc.vendor == "google":
        found = len(target.host.run("ls /dev/accel* /dev/vfio/[0-9]* 2>/dev/null").stdout.split())
    else:
        # The cpu profile: the replicas' cores are the device; the host must have them.
        found = count if int(target.host.run("nproc").stdout.strip()) >= 1 else 0
    assert found >= count, f"{acc.name}: {found} visible, plan needs {count}"


# --- units and ports -------------------------------------------------------------------------------


def test_replica_unit_enabled_and_active(target, replica):
    service = target.host.service(f"vllm@{replica.index}.service")
    assert service.is_enabled and service.is_running


@pytest.mark.parametrize("unit", ["haproxy.service", "gemmaserve-cache-restore.service", "prometheus.service"])
def test_support_unit_enabled_and_active(target, unit):
    service = target.host.service(unit)
    assert service.is_enabled and service.is_running


def test_replica_listens_on_its_planned_address(target, replica):
    address = target.plan.spec.serving.bind_address
    assert target.host.socket(f"tcp://{address}:{replica.port}").is_listening


def test_router_listens(target):
    assert target.host.socket(f"tcp://0.0.0.0:{target.plan.router_port}").is_listening


def test_haproxy_backend_up(target, replica):
    rows = json.loads(target.host.run("python3 /opt/gemmaserve/lib/haproxy_admin.py status vllm").stdout)
    assert rows.get(f"replica{replica.index}") == "UP"


def test_replica_runs_the_planned_argv(target, replica):
    pid = server_pid(target.host, replica.index)
    assert pid, f"no vllm serve process in vllm@{replica.index}.service"
    cmdline = target.host.file(f"/proc/{pid}/cmdline").content_string.split("\0")
    assert replica.argv[2:] == cmdline[cmdline.index("serve") + 1 :][: len(replica.argv) - 2]


# --- the endpoint, through the host's load balancer -----------------------------------------------


def test_health(target):
    assert target.call("/health", key=None)[0] == 200


def test_models_lists_the_served_model(target):
    code, body = target.call("/v1/models")
    assert code == 200 and target.plan.model.hf_id in [m["id"] for m in json.loads(body)["data"]]


def test_chat_completion(target):
    payload = {"model": target.plan.model.hf_id, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}
    code, body = target.call("/v1/chat/completions", payload)
    assert code == 200 and json.loads(body)["usage"]["completion_tokens"] > 0


def test_json_schema_output_validates(target):
    payload = {
        "model": target.plan.model.hf_id,
        "max_tokens": 400,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Weather in Paris as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
    }
    code, body = target.call("/v1/chat/completions", payload)
    assert code == 200
    assert schema_problems(json.loads(json.loads(body)["choices"][0]["message"]["content"])) == []


def test_tools_request_accepted(target):
    payload = {
        "model": target.plan.model.hf_id,
        "max_tokens": 16,
        "tools": [WEATHER_TOOL],
        "messages": [{"role": "user", "content": "Weather in Tokyo?"}],
    }
    assert target.call("/v1/chat/completions", payload)[0] == 200


# --- who may call: a key, TLS, and only the client routes ------------------------------------------


@pytest.mark.parametrize("key", [None, "gsk-not-a-key-of-this-host"], ids=["no-key", "wrong-key"])
def test_endpoint_refuses_a_caller_without_a_valid_key(target, key):
    code, body = target.call("/v1/models", key=key)
    assert code == 401 and json.loads(body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/metrics", "/tokenize", "/server_info", "/docs"])
def test_endpoint_serves_only_the_client_routes(target, path):
    assert target.call(path)[0] == 404


def test_endpoint_refuses_plain_http(target):
    plain = target.endpoint.url("/health").replace("https://", "http://", 1)
    with pytest.raises(EndpointError):
        request(plain, timeout=10)


@pytest.mark.parametrize("metric", ALERT_METRICS)
def test_replica_metrics_carry_what_the_alerts_use(target, metric):
    # Read where Prometheus reads them: each replica on the host's loopback (the balancer hides /metrics).
    code, body = target.replica_get(target.plan.replicas[0], "/metrics")
    assert code == 200
    assert metric in {sample.name for family in text_string_to_metric_families(body) for sample in family.samples}


# --- secrets and caches ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["/etc/systemd/system/vllm@.service", "/etc/gemmaserve/replica-*.env"])
def test_no_token_in_unit_or_env_files(target, where):
    assert not re.search(r"HF_TOKEN=|hf_[A-Za-z0-9]{20,}", target.host.run(f"cat {where}").stdout)


def test_api_key_not_in_haproxy_or_vllm_logs(target):
    key = target.endpoint.credentials.api_key
    if key is None:
        pytest.fail(f"set {API_KEY_ENV}: the key whose absence from the logs is checked", pytrace=False)
    target.call("/v1/models")  # a request with it, just now
    # Read here and searched here: the key is never sent to the host.
    logs = target.host.run("journalctl -u haproxy -u 'vllm@*' --since -1h --no-pager -o cat").stdout
    assert "GET /v1/models" in logs and key not in logs


def test_no_token_in_replica_environment(target, replica):
    pid = server_pid(target.host, replica.index)
    assert pid, f"no vllm serve process in vllm@{replica.index}.service"
    environ = target.host.run(f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout
    assert "HF_TOKEN=" not in environ
    if target.plan.token_source_path:
        assert f"HF_TOKEN_PATH=/run/credentials/vllm@{replica.index}.service/hf-token" in environ
    else:  # weights from the mirror: the token is not on the host at all
        assert "HF_TOKEN_PATH=" not in environ


def test_replica_reports_ready(target, replica):
    """The unit's status line separates loading and compiling from serving (roles/replicas/files/replica_ready.py)."""
    text = target.host.run(f"systemctl show -p StatusText --value vllm@{replica.index}").stdout
    assert text.startswith("ready"), text


def test_weights_are_local_before_replicas(target):
    """Pulled from the mirror: one verified local copy and a finished fetch unit; a directory: its config.json;
    from the hub, or pinned hub adapters or MTP assistant beside a directory or gs:// model: the prefetch unit
    finished; streamed: nothing local by design."""
    weights = target.plan.weights
    wheel = target.plan.engine.kind == "wheel"
    if weights.mode == "pull":
        assert target.host.file(f"{weights.local_dir}/.gemmaserve-complete").is_file
    if weights.mode == "local":
        assert target.host.file(f"{target.plan.model.local_dir}/config.json").is_file
    if weights.mode == "pull" or (wheel and (weights.mode == "hub" or weights.hub_adapters or weights.hub_assistant)):
        assert target.host.run("systemctl is-active gemmaserve-weights").stdout.strip() == "active"


def test_compile_cache_on_tmpfs(target, replica):
    cache = next(v for k, v in replica.env.items() if k in ("VLLM_CACHE_ROOT", "VLLM_XLA_CACHE_PATH"))
    assert target.host.run(f"stat -f -c %T {cache.rsplit('/', 2)[0]}").stdout.strip() == "tmpfs"


def test_compile_cache_restore_ran(target):
    log = target.host.run("journalctl -u gemmaserve-cache-restore -b --no-pager -o cat").stdout
    assert re.search(r"restore took [0-9.]+ s", log)
