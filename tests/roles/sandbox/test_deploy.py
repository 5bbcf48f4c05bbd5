"""A real `pyinfra hosts/sandbox.py deploy.py` of the cpu profile, checked as a user and an SRE would."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from gemmaserve.ops import fleet
from gemmaserve.ops.endpoint import CITY_SCHEMA, WEATHER_TOOL, check_endpoint, schema_problems
from gemmaserve.ops.verify.processes import server_pid
from gemmaserve.plan import plan
from gemmaserve.sandbox.profile import OVERRIDE_ENV, sandbox_host_data
from gemmaserve.sources import load_stack_spec, spec_from_host_data
from tests import ROOT
from tests.ops.test_status import closed_loopback_port
from tests.sandbox_fixtures import deploy, sandbox_endpoint

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def sandbox_plan():
    return plan(spec_from_host_data(sandbox_host_data(), "sandbox")).require_ok()


@pytest.fixture(scope="module")
def deployed(sandbox_hosts):
    host = sandbox_hosts[0]
    result = deploy(host.name)
    assert result.ok, result.output[-4000:]
    print(f"\n[figure] first deploy to {host.name}: {result.seconds:.1f} s")
    return host, result


@pytest.fixture(scope="module")
def endpoint(deployed):
    """The host's balancer as a client calls it: TLS against the sandbox's CA, with the sandbox's key."""
    host, _ = deployed
    return sandbox_endpoint(host)


@pytest.fixture(scope="module")
def client(endpoint):
    return endpoint.openai(timeout=120)


def test_deploy_runs_every_role(deployed):
    _, result = deployed
    for role in ("Prepare the host", "Install vLLM", "Run vLLM replicas", "Route with HAProxy"):
        assert f"{role} | " in result.output
    assert result.totals()[0] >= 20


def test_second_deploy_reports_no_changes(deployed):
    host, _ = deployed
    result = deploy(host.name)
    seconds = result.seconds
    assert result.ok, result.output[-3000:]
    print(f"\n[figure] no-op redeploy of {host.name}: {seconds:.1f} s")
    assert result.totals()[1] == 0


@pytest.mark.parametrize(
    "decision",
    [
        "noop: /etc/systemd/system/vllm@.service is up to date",
        "noop: /etc/gemmaserve/replica-0.env already holds the planned flags",
        "noop: vllm@0.service is running, enabled",
        "noop: haproxy installed",
        "noop: /etc/haproxy/haproxy.cfg.gemmaserve is up to date",
        "noop: the gemmaserve user and group exist",
        "noop: /etc/gemmaserve/api-keys exists; keys are added and revoked with `gemmaserve keys`",
        "noop: /etc/gemmaserve/tls.pem is up to date",
    ],
)
def test_dry_run_of_a_converged_host_lists_each_noop_decision(deployed, decision):
    """`pyinfra --dry` shows every decision the roles make on a converged host, and changes nothing."""
    host, _ = deployed
    result = dry_run_of_converged(host.name)
    assert decision in result.output


_DRY_RUNS: dict[str, object] = {}


def dry_run_of_converged(name: str):
    if name not in _DRY_RUNS:
        deploy(name)  # converged first, whatever earlier tests did
        _DRY_RUNS[name] = fleet.run_pyinfra(limit=[name], dry=True)
        assert _DRY_RUNS[name].ok, _DRY_RUNS[name].output[-3000:]
        assert _DRY_RUNS[name].proposed_changes() == []
    return _DRY_RUNS[name]


def test_drift_is_mended_and_the_replica_keeps_running(deployed, sandbox_host):
    """What the one-question-per-role snapshot must notice: a changed config, a wrong owner or mode,
    a stopped or disabled unit. An env file with the right flags but the wrong owner is mended
    without restarting its replica."""
    host, _ = deployed
    started = sandbox_host.run("systemctl show -p ActiveEnterTimestampMonotonic --value vllm@0").stdout.strip()
    drift = (
        "echo '# drift' >> /etc/haproxy/haproxy.cfg.gemmaserve && chmod 0755 /etc/gemmaserve"
        " && chown root:root /etc/gemmaserve/replica-0.env && systemctl stop prometheus"
        " && systemctl disable --quiet gemmaserve-cache-save.timer"
    )
    assert sandbox_host.run(drift).rc == 0
    result = deploy(host.name)
    assert result.ok, result.output[-3000:]
    assert sandbox_host.file("/etc/gemmaserve").mode == 0o750
    env = sandbox_host.file("/etc/gemmaserve/replica-0.env")
    assert (env.user, env.group, env.mode) == ("root", "gemmaserve", 0o640)
    assert "# drift" not in sandbox_host.file("/etc/haproxy/haproxy.cfg.gemmaserve").content_string
    assert sandbox_host.service("prometheus").is_running
    assert sandbox_host.service("gemmaserve-cache-save.timer").is_enabled
    assert sandbox_host.run("systemctl show -p ActiveEnterTimestampMonotonic --value vllm@0").stdout.strip() == started
    assert deploy(host.name).totals()[1] == 0


def test_model_list(client, sandbox_plan):
    assert [m.id for m in client.models.list().data] == [sandbox_plan.model.hf_id]


def test_chat_completion(client, sandbox_plan):
    reply = client.chat.completions.create(
        model=sandbox_plan.model.hf_id, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_json_schema_output_is_valid(client, sandbox_plan):
    reply = client.chat.completions.create(
        model=sandbox_plan.model.hf_id,
        max_tokens=400,
        temperature=0,
        messages=[{"role": "user", "content": "Weather in Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city-weather", "schema": CITY_SCHEMA}},
    )
    document = json.loads(reply.choices[0].message.content)
    assert schema_problems(document) == []


def test_request_with_tools_is_accepted(client, sandbox_plan):
    reply = client.chat.completions.create(
        model=sandbox_plan.model.hf_id,
        max_tokens=16,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        messages=[{"role": "user", "content": "What is the weather in Tokyo?"}],
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streaming_passes_through_haproxy(client, sandbox_plan):
    stream = client.chat.completions.create(
        model=sandbox_plan.model.hf_id,
        max_tokens=8,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": "Count"}],
    )
    chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert len(chunks) >= 2


def test_the_demos_endpoint_check_passes(endpoint):
    """What `make demo` runs last: models, chat, json_schema, tools with the key; no key and /metrics refused."""
    report = check_endpoint(endpoint.base_url, endpoint.credentials)
    assert report.refused == {"no key": 401, "/metrics": 404} and report.models


def replica_metrics(sandbox_host) -> str:
    """vLLM's /metrics where Prometheus reads it: the replica on the host's loopback (the balancer hides it)."""
    return sandbox_host.run("curl -fsS -m 10 http://127.0.0.1:8000/metrics").stdout


def test_metrics_carry_kv_cache_usage(deployed, sandbox_host):
    assert "vllm:kv_cache_usage_perc" in replica_metrics(sandbox_host)


def test_sandbox_status_reports_the_endpoint_key_and_ca(deployed, endpoint):
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "sandbox", "status", "--json"], capture_output=True, text=True, check=True
    )
    record = {h["name"]: h for h in json.loads(result.stdout)["hosts"]}[deployed[0].name]
    assert record["endpoint"] == endpoint.base_url and record["endpoint"].startswith("https://")
    assert (record["api_key"], record["ca_cert"]) == (endpoint.credentials.api_key, endpoint.credentials.ca_cert)
    # What a script does with them: the OpenAI SDK, trusting that CA, with that key.
    from gemmaserve.ops.endpoint import Credentials

    listed = Credentials(record["api_key"], record["ca_cert"]).openai(record["endpoint"]).models.list()
    assert [m.id for m in listed.data]


# --- the host, as testinfra sees it ------------------------------------------------------------


@pytest.mark.parametrize("unit", ["vllm@0.service", "haproxy.service"])
def test_unit_enabled_and_active(deployed, sandbox_host, unit):
    service = sandbox_host.service(unit)
    assert service.is_running and service.is_enabled


def test_target_enabled(deployed, sandbox_host):
    assert sandbox_host.service("gemmaserve.target").is_enabled


@pytest.mark.parametrize("spec", ["tcp://0.0.0.0:8080", "tcp://127.0.0.1:8000"])
def test_listening(deployed, sandbox_host, spec):
    assert sandbox_host.socket(spec).is_listening


def test_replica_not_exposed_beyond_loopback(deployed, sandbox_host):
    assert not sandbox_host.socket("tcp://0.0.0.0:8000").is_listening


RENDERED_UNITS = [
    "vllm@0.service",
    "gemmaserve.target",
    "gemmaserve-api-keys.service",
    "gemmaserve-cache-restore.service",
    "gemmaserve-cache-save.service",
    "gemmaserve-cache-save.timer",
]


@pytest.mark.parametrize("unit", RENDERED_UNITS)
def test_units_pass_systemd_analyze_verify(deployed, sandbox_host, unit):
    result = sandbox_host.run(
        f"systemd-analyze verify /etc/systemd/system/{unit.replace('@0', '@')}"
        if "@" in unit
        else f"systemd-analyze verify /etc/systemd/system/{unit}"
    )
    assert result.rc == 0 and result.stdout.strip() == "" and result.stderr.strip() == "", result.stderr


def test_replica_unit_is_hardened(deployed, sandbox_host):
    output = sandbox_host.run("systemd-analyze security --no-pager vllm@0.service").stdout
    exposure = float(re.search(r"Overall exposure level for vllm@0.service: ([0-9.]+)", output)[1])
    print(f"\n[figure] systemd-analyze security exposure of vllm@0.service: {exposure}")
    assert exposure <= 5.0


def test_haproxy_config_is_valid(deployed, sandbox_host):
    assert sandbox_host.run("haproxy -c -q -f /etc/haproxy/haproxy.cfg").rc == 0


def test_haproxy_routes_by_the_plans_policy(deployed, sandbox_host, sandbox_plan):
    config = sandbox_host.file("/etc/haproxy/haproxy.cfg").content_string
    routing = sandbox_plan.routing
    assert routing.prefix_affinity, "the sandbox profile serves the default policy"
    assert "balance hash var(txn.route_key)" in config and "hash-type consistent" in config
    assert f"hash-balance-factor {routing.load_bound_percent}" in config
    assert f"maxconn {routing.replica_max_requests} weight 100" in config


def test_replica_env_file_matches_the_plan(deployed, sandbox_host, sandbox_plan):
    # vLLM's environment: the unit's env file with a venv, the container's own under podman.
    path = "/etc/gemmaserve/replica-0" + (".container.env" if sandbox_plan.engine.kind == "container" else ".env")
    content = sandbox_host.file(path).content_string
    for key, value in sandbox_plan.replicas[0].env.items():
        assert f"{key}={value}\n" in content
    assert sandbox_host.file(path).mode == 0o640


def test_vllm_runs_the_planned_argv(deployed, sandbox_host, sandbox_plan):
    pid = server_pid(sandbox_host, 0)
    cmdline = sandbox_host.file(f"/proc/{pid}/cmdline").content_string.split("\0")
    assert cmdline[cmdline.index("serve") + 1 :][:-1] == sandbox_plan.replicas[0].argv[2:]


def test_compile_caches_on_tmpfs(deployed, sandbox_host, sandbox_plan):
    cache = sandbox_plan.replicas[0].env["VLLM_CACHE_ROOT"]
    assert cache.startswith("/dev/shm/")
    assert sandbox_host.run(f"stat -f -c %T {cache.rsplit('/', 1)[0]}").stdout.strip() == "tmpfs"


def test_replica_runs_as_the_service_user(deployed, sandbox_host):
    assert sandbox_host.run("systemctl show -p User --value vllm@0").stdout.strip() == "gemmaserve"


# --- vLLM's own parser, on the host where the template is installed ---------------------------


def _all_planned_argvs() -> list[list[str]]:
    from tests.unit import test_published_setups as published

    specs = [load_stack_spec(s, ROOT) for s in ("tpu-v6e4", "tpu-v6e1", "gpu8", "a100", "h100")]
    argvs = [r.argv for spec in specs for r in plan(spec).replicas]
    from gemmaserve.spec import parse_spec

    published_specs = [
        published.CALLSTACK_SPEC,
        published.TURBO_STABLE_SPEC,
        {
            **published.CALLSTACK_SPEC,
            "workload": {**published.CALLSTACK_SPEC["workload"], "speculative": {"method": "mtp"}},
        },
    ]
    argvs += [r.argv for data in published_specs for r in plan(parse_spec(data)).replicas]
    return argvs


@pytest.fixture(scope="module")
def argcheck_on_host(deployed, sandbox_host, sandbox_plan):
    argvs = _all_planned_argvs()
    typo = list(argvs[0])
    typo[typo.index("--gpu-memory-utilization")] = "--gpu-memory-utilisation"
    payload = json.dumps(argvs + [typo])
    sandbox_host.run(f"cat > /tmp/argvs.json <<'EOF'\n{payload}\nEOF")
    result = sandbox_host.run(
        f"{sandbox_plan.engine.venv}/bin/python /opt/gemmaserve/lib/vllm_argcheck.py /tmp/argvs.json"
    )
    verdicts = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result.rc, verdicts, len(argvs)


def test_every_stack_and_published_argv_passes_vllms_parser(argcheck_on_host):
    _, verdicts, planned = argcheck_on_host
    assert len(verdicts) == planned + 1
    bad = [(v["argv"][2], v["error"]) for v in verdicts[:planned] if not v["ok"]]
    assert bad == []


def test_vllms_parser_rejects_a_typo(argcheck_on_host):
    rc, verdicts, _ = argcheck_on_host
    assert rc == 1
    assert not verdicts[-1]["ok"] and "gpu-memory-utilisation" in verdicts[-1]["error"]


# --- bad input stops before anything changes ---------------------------------------------------


def test_bad_host_data_fails_before_any_change(deployed, sandbox_host, tmp_path):
    host, _ = deployed
    before = sandbox_host.run("sha256sum /etc/gemmaserve/replica-0.env /etc/systemd/system/vllm@.service").stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"gemmaserve_workload": {"max_model_len": 1024, "gpu_memory_utilization": 1.7}}))
    result = fleet.run_pyinfra(limit=[host.name], env={OVERRIDE_ENV: str(bad)})
    output = result.output
    assert result.returncode != 0
    assert "workload.gpu_memory_utilization = 1.7" in output and "less than or equal to 0.98" in output
    assert "Starting operation" not in output
    assert (
        sandbox_host.run("sha256sum /etc/gemmaserve/replica-0.env /etc/systemd/system/vllm@.service").stdout == before
    )


def test_plan_capacity_matches_vllms_own_accounting(deployed, sandbox_host, sandbox_plan):
    """The planner's KV-cache blocks, tokens and concurrency equal what the real vLLM computed."""
    body = replica_metrics(sandbox_host)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', re.search(r"vllm:cache_config_info\{([^}]*)\}", body)[1]))
    capacity = sandbox_plan.replicas[0].capacity
    print(
        f"\n[figure] vLLM: {labels['num_gpu_blocks']} blocks, {labels['kv_cache_size_tokens']} tokens, "
        f"{float(labels['kv_cache_max_concurrency']):.2f}x; plan: {capacity.num_blocks} blocks, "
        f"{capacity.kv_cache_tokens} tokens, {capacity.max_concurrency:.2f}x"
    )
    assert int(labels["num_gpu_blocks"]) == capacity.num_blocks
    assert int(labels["kv_cache_size_tokens"]) == capacity.kv_cache_tokens
    assert float(labels["kv_cache_max_concurrency"]) == pytest.approx(capacity.max_concurrency, rel=1e-9)


def test_gemmaserve_status_reports_the_replica(deployed, sandbox_plan):
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "status", "--inventory", "hosts/sandbox.py", "--limit", deployed[0].name]
        + ["--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (replica,) = json.loads(result.stdout)["replicas"]
    assert replica["host"] == deployed[0].name
    assert replica["state"] == "active" and replica["healthy"] is True
    assert replica["model"] == sandbox_plan.model.hf_id
    assert 0.0 <= replica["kv_cache_usage"] <= 1.0 and replica["waiting"] == 0.0
    # Through the balancer with the sandbox's key (no GEMMASERVE_API_KEY set: a sandbox host has its own).
    assert replica["endpoint"] == "ok"


def test_status_reads_a_serving_host_while_another_is_down(deployed, tmp_path):
    """One host of the inventory down (nothing listens on its ssh port) costs its rows, not the report."""
    host = deployed[0]
    (this,) = fleet.load("hosts/sandbox.py", [host.name])
    data = dict(this.data)
    ghost = {**data, "ssh_hostname": "127.0.0.1", "ssh_port": closed_loopback_port(), "gemmaserve_sandbox": False}
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f"hosts = [('ghost', {ghost!r}), ({host.name!r}, {data!r})]\n")
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "status", "--inventory", str(inventory), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "unreachable over ssh: ghost" in result.stderr, result.stderr[-2000:]
    rows = {r["host"]: r for r in json.loads(result.stdout)["replicas"]}
    assert rows["ghost"]["state"] == "unreachable" and "Unable to connect" in rows["ghost"]["phase"]
    assert rows[host.name]["state"] == "active" and rows[host.name]["healthy"] is True
    assert rows[host.name]["endpoint"] == "ok"


def test_verify_suite_passes_against_the_sandbox(deployed):
    """The product's own verification suite (tests/verify), run as a user would, against this host."""
    result = subprocess.run(
        [sys.executable, "-m", "gemmaserve", "verify", "--inventory", "hosts/sandbox.py", "--limit", deployed[0].name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]
    print(f"\n[figure] gemmaserve verify: {summary}")
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary


def test_bench_scaled_down_sweep_writes_table_json_and_plot(deployed, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gemmaserve",
            "bench",
            "--inventory",
            "hosts/sandbox.py",
            "--limit",
            deployed[0].name,
            "--profile",
            "balanced",
            "--profile",
            "prompt-heavy",
            "--concurrency",
            "1,2",
            "--scale",
            "0.01",
            "--prompts-per-level",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    points = json.loads((tmp_path / "bench.json").read_text())["points"]
    assert {(p["profile"], p["concurrency"]) for p in points} == {
        ("balanced", 1),
        ("balanced", 2),
        ("prompt-heavy", 1),
        ("prompt-heavy", 2),
    }
    assert all(p["results"]["completed"] == p["num_prompts"] and p["results"]["output_throughput"] > 0 for p in points)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "gemmaserve bench" in result.stdout


def test_a_container_deploy_without_a_runtime_fails_before_any_operation(deployed, sandbox_host, tmp_path):
    """This wheel host has no podman; told not to install one, a container deploy stops before it starts.
    (Here, not in test_container_mode.py: that module runs on make test's other worker, beside this one,
    with no host of this worker's: tests/conftest.py.)"""
    host, _ = deployed
    assert not sandbox_host.exists("podman")
    data = {
        "gemmaserve_engine": {"kind": "container", "image": "localhost/gemmaserve/vllm-cpu:0.32.0@sha256:" + "1" * 64},
        "vllm_install_runtime": False,
    }
    result = deploy(host.name, data, tmp_path)
    assert result.returncode != 0, result.output[-3000:]
    assert "vllm@0.service run localhost/gemmaserve/vllm-cpu:0.32.0@sha256:" in result.output
    assert "the container runtime /usr/bin/podman is missing and vllm_install_runtime is false" in result.output
    assert "Starting operation" not in result.output
