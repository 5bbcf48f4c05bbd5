"""Container mode on a sandbox host: the same two replicas as tests/roles/sandbox/test_resilience.py,
served by podman from the locally built image (run by digest), through the same roles, units and checks.

The tests that hold for both engines are imported from test_deploy.py and test_resilience.py and run here
again against this module's fixtures (pytest resolves a test's fixtures where it is collected); the
tests below them are about containers only: the image, the runtime's confinement, bad input, the real
podman CLI given GPU device requests, and the registry credential helper.

Of test_resilience.py's tests, those whose path differs with the engine run here again: a SIGKILLed vLLM
(a process inside the container: conmon and podman must end the unit so systemd restarts it), a plain stop
under load (the engine's own stop path: podman's stop signal and timeout instead of systemd's KillSignal),
and a reboot (the container starts again after /run, podman's runroot, is wiped; its state checked by
test_reboot_brings_units_router_and_compile_cache_back, after an idle reboot here). These run once, on the
wheel host only, because the engine does not enter them: the deploy's rolling restart (the replicas role's
drain-restart-ready loop around `systemctl restart`, whose stop half is the plain stop above), the reboot
under load (its order, HAProxy's graceful stop before any replica's, is the router-drain unit; each
replica's stop under load is the plain stop above), the unchanged-replica and scale-down deploy decisions.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from gemmaserve.ops import fleet
from gemmaserve.ops.bench import RESULT_DIR, bench_command
from gemmaserve.ops.verify.processes import server_pid
from gemmaserve.plan import plan
from gemmaserve.sandbox import state
from gemmaserve.sandbox.profile import container_engine_data, sandbox_host_data
from gemmaserve.sources import load_stack_spec, spec_from_host_data
from gemmaserve.spec import parse_spec
from roles._lib.render import render
from roles.replicas import (
    TEMPLATES,
    argcheck_command,
    container_flags,
    render_container_env,
    render_env,
    unit_context,
)
from roles.vllm import CREDENTIAL_HELPER, CREDENTIAL_HELPER_NAME, registry_auth
from tests.roles.sandbox.test_deploy import (  # noqa: F401 - fixtures and tests collected again here
    client,
    endpoint,
    test_chat_completion,
    test_haproxy_config_is_valid,
    test_json_schema_output_is_valid,
    test_metrics_carry_kv_cache_usage,
    test_model_list,
    test_replica_env_file_matches_the_plan,
    test_request_with_tools_is_accepted,
    test_second_deploy_reports_no_changes,
    test_streaming_passes_through_haproxy,
    test_units_pass_systemd_analyze_verify,
    test_verify_suite_passes_against_the_sandbox,
    test_vllm_runs_the_planned_argv,
)
from tests.roles.sandbox.test_resilience import (  # noqa: F401 - tests collected again here
    TOKEN,
    Reboot,
    haproxy_status,
    reboot_host,
    test_both_replicas_serve_behind_haproxy,
    test_plain_stop_under_load_finishes_every_accepted_request,
    test_reboot_brings_units_router_and_compile_cache_back,
    test_sigkilled_replica_fails_no_request_sent_after_the_kill_and_is_restarted,
    test_token_and_api_key_absent,
    test_token_and_api_key_absent_from_pyinfra_output,
    test_token_file_on_disk_is_root_only,
    test_token_reaches_vllm_as_a_credential,
    two_replica_data,
    used_api_key,
)
from tests.sandbox_fixtures import bring_up_new, deploy, sandbox_endpoint, wait_until

pytestmark = pytest.mark.sandbox

ROOT = Path(__file__).resolve().parents[3]
PODMAN = "/usr/bin/podman"


# --- this module's host: container mode, two replicas ---------------------------------------------


@pytest.fixture(scope="module")
def container_host(request, sandbox_ready, served_image, tmp_path_factory):
    """A host of its own, booted after the image exists (its archive is bound read-only), recorded with
    this module's host data (test_resilience's two replicas, from the image): every deploy, `verify`
    and `status` through hosts/sandbox.py plans what it runs, as after `gemmaserve demo --engine container`."""
    [host] = bring_up_new(1, request)
    data = {
        **container_engine_data(served_image.reference, served_image.archive),
        **two_replica_data(tmp_path_factory.mktemp("container")),
    }
    state.set_host_data(host.name, data)
    host.host_data = data
    return host


@pytest.fixture(scope="module")
def sandbox_host(container_host, sandbox_ssh_config):
    import testinfra

    return testinfra.get_host(
        f"paramiko://{state.SSH_USER}@{container_host.address}",
        ssh_config=sandbox_ssh_config,
        ssh_identity_file=str(state.SSH_KEY),
    )


@pytest.fixture(scope="module")
def two_replicas(container_host, sandbox_host, tmp_path_factory):
    """test_resilience's fixture, here: (host, plan, pyinfra output, a directory for override files)."""
    result = deploy(container_host.name)
    assert result.returncode == 0, result.output[-4000:]
    print(f"\n[figure] first deploy of two container replicas to {container_host.name}: {result.seconds:.1f} s")
    host_plan = plan(spec_from_host_data(sandbox_host_data(container_host.host_data))).require_ok()
    assert host_plan.engine.kind == "container" and len(host_plan.replicas) == 2
    return container_host, host_plan, result.output, tmp_path_factory.mktemp("overrides")


@pytest.fixture(scope="module")
def rebooted(two_replicas, sandbox_host) -> Reboot:
    """An idle reboot of the container host, after the plain stop (see the module's docstring)."""
    host, host_plan, _, _ = two_replicas
    return reboot_host(host, host_plan, sandbox_host)


@pytest.fixture(scope="module")
def deployed(two_replicas):
    host, _, output, _ = two_replicas
    return host, output


@pytest.fixture(scope="module")
def sandbox_plan(two_replicas):
    return two_replicas[1]


# --- the image and the runtime --------------------------------------------------------------------


def inspect(sandbox_host, what: str, fmt: str) -> str:
    return sandbox_host.run(f"{PODMAN} inspect --format {shlex.quote(fmt)} {what}").stdout.strip()


@pytest.mark.parametrize("index", [0, 1])
def test_replica_runs_the_image_by_digest(two_replicas, sandbox_host, served_image, index):
    # podman records a reference by digest without its tag: the digest is what runs.
    repository = served_image.by_tag.rsplit(":", 1)[0]
    assert inspect(sandbox_host, f"vllm-{index}", "{{.ImageName}}") == f"{repository}@{served_image.digest}"
    assert inspect(sandbox_host, f"vllm-{index}", "{{.ImageDigest}}") == served_image.digest


def test_container_environment_is_exactly_the_plans(two_replicas, sandbox_host):
    """The container gets the plan's variables, nothing of the unit's own (VLLM_ARGS, GEMMASERVE_*)."""
    _, host_plan, _, _ = two_replicas
    env = dict(e.split("=", 1) for e in json.loads(inspect(sandbox_host, "vllm-1", "{{json .Config.Env}}")))
    assert {k: env[k] for k in host_plan.replicas[1].env} == host_plan.replicas[1].env
    assert not [k for k in env if k.startswith("GEMMASERVE_") or k == "VLLM_ARGS"]


def test_vllm_runs_confined_in_the_units_cgroup(two_replicas, sandbox_host):
    """The container's vLLM is a process of vllm@0.service (podman's --cgroups=disabled), as the
    gemmaserve user, with no capabilities, no new privileges and a read-only root file system."""
    pid = server_pid(sandbox_host, 0)
    assert pid and pid != sandbox_host.run("systemctl show -p MainPID --value vllm@0").stdout.strip()
    status = sandbox_host.file(f"/proc/{pid}/status").content_string
    uid = sandbox_host.run("id -u gemmaserve").stdout.strip()
    assert re.search(rf"^Uid:\s+{uid}\s", status, re.M)
    assert re.search(r"^CapEff:\s+0+$", status, re.M) and re.search(r"^NoNewPrivs:\s+1$", status, re.M)
    assert sandbox_host.run(f"nsenter -t {pid} -m touch /opt/probe").rc != 0
    assert inspect(sandbox_host, "vllm-0", "{{.HostConfig.ReadonlyRootfs}}") == "true"


def test_podman_runs_no_daemon(two_replicas, sandbox_host):
    for unit in ("podman.socket", "podman.service"):
        assert sandbox_host.run(f"systemctl is-active {unit}").stdout.strip() != "active"
        assert sandbox_host.run(f"systemctl is-enabled {unit}").stdout.strip() != "enabled"


@pytest.mark.parametrize(
    "where, command",
    [
        ("podman inspect of the containers", f"{PODMAN} inspect vllm-0 vllm-1"),
        (
            "the images' config and history",
            f"{PODMAN} image inspect $({PODMAN} images -q); {PODMAN} history --no-trunc $({PODMAN} images -q)",
        ),
        ("the containers' environment", f"{PODMAN} exec vllm-0 env; {PODMAN} exec vllm-1 env"),
    ],
)
def test_token_and_api_key_absent_from_container_state(used_api_key, sandbox_host, where, command):  # noqa: F811
    output = sandbox_host.run(command).stdout
    assert len(output) > 100, f"{where}: nothing read, the check would be vacuous"
    assert TOKEN not in output
    assert used_api_key not in output


def test_token_absent_from_image_layers_and_container_storage(two_replicas, sandbox_host):
    """Every file podman stores (the image's layers, the containers' own) is free of the token; the
    token file itself is there to prove the search finds what it looks for."""
    storage = "/var/lib/containers/storage"
    assert sandbox_host.run(f"grep -rlF {TOKEN} /etc/gemmaserve/hf-token").rc == 0
    found = sandbox_host.run(f"grep -rlF {TOKEN} {storage} /run/containers 2>/dev/null")
    assert found.rc == 1 and found.stdout == "", found.stdout
    assert int(sandbox_host.run(f"du -sm {storage}").stdout.split()[0]) > 1000  # the image is there


def test_flags_are_checked_inside_the_image(two_replicas, sandbox_host):
    """vLLM's parser from the image, as the replicas role runs it before a restart: a typo is refused."""
    _, host_plan, _, _ = two_replicas
    command = argcheck_command(host_plan)
    good = host_plan.replicas[0].argv
    typo = [a.replace("--max-model-len", "--max-model-length") for a in good]
    result = sandbox_host.run(f"{command} -- {shlex.join(typo[2:])}")
    assert result.rc == 1 and "max-model-length" in result.stdout
    assert sandbox_host.run(f"{command} -- {shlex.join(good[2:])}").rc == 0


# --- bad input: a clear error naming the replica and the cause, before the running replica changes ---


def unit_and_env(sandbox_host) -> str:
    return sandbox_host.run(
        "sha256sum /etc/systemd/system/vllm@.service /etc/gemmaserve/replica-*.env; "
        "systemctl show -p ActiveEnterTimestampMonotonic --value vllm@0 vllm@1"
    ).stdout


def deploy_expecting_error(host, data, tmp_path) -> str:
    result = deploy(host.name, data, tmp_path)
    assert result.returncode != 0, result.output[-3000:]
    return result.output


def test_unpinned_image_is_refused_before_any_operation(two_replicas, sandbox_host):
    host, _, _, tmp_path = two_replicas
    before = unit_and_env(sandbox_host)
    data = {**two_replica_data(tmp_path), "gemmaserve_engine": {"kind": "container", "image": "localhost/vllm:latest"}}
    output = deploy_expecting_error(host, data, tmp_path)
    assert "engine.image = 'localhost/vllm:latest'" in output and "must be pinned" in output
    assert "Starting operation" not in output
    assert unit_and_env(sandbox_host) == before


@pytest.mark.parametrize("source", ["archive", "registry"])
def test_missing_image_fails_naming_the_replicas(two_replicas, sandbox_host, served_image, source):
    """An image that is in neither the archive nor the registry (here: a digest nobody published)."""
    host, _, _, tmp_path = two_replicas
    before = unit_and_env(sandbox_host)
    absent = f"{served_image.by_tag}@sha256:{'0' * 64}"
    data = {**two_replica_data(tmp_path), "gemmaserve_engine": {"kind": "container", "image": absent}}
    if source == "registry":
        data["vllm_image_archive"] = None
    output = deploy_expecting_error(host, data, tmp_path)
    assert f"{absent} for vllm@0.service, vllm@1.service" in output
    assert ("not in " + served_image.archive) in output if source == "archive" else "could not pull it" in output
    assert unit_and_env(sandbox_host) == before


def test_image_without_vllm_fails_before_the_replica_is_touched(two_replicas, sandbox_host):
    """A container that exits at once (an image with no vLLM in it): vLLM's parser cannot run in it, so
    the deploy stops at the flag check, before the unit changes or any replica restarts."""
    host, _, _, tmp_path = two_replicas
    sandbox_host.run(f"tar -C / -c usr/bin/true | {PODMAN} import --quiet - localhost/gemmaserve/no-vllm:1.0")
    before = unit_and_env(sandbox_host)
    data = {
        **two_replica_data(tmp_path),
        "gemmaserve_engine": {"kind": "container", "image": "localhost/gemmaserve/no-vllm:1.0"},
    }
    output = deploy_expecting_error(host, data, tmp_path)
    assert "replica 0 (vllm@0): vLLM in localhost/gemmaserve/no-vllm:1.0 rejected its flags or could not run" in output
    assert "the running replica was not touched" in output
    assert unit_and_env(sandbox_host) == before
    assert set(haproxy_status(sandbox_host).values()) == {"UP"}


# --- the real podman CLI, given what a GPU host's unit renders ----------------------------------------

# CDI specs in the format `nvidia-ctk cdi generate` writes (https://github.com/cncf-tags/container-device-interface/blob/main/SPEC.md):
# one device per GPU index and the control node every container gets. The nodes are made on the host
# with NVIDIA's major number (195) so podman resolves them; no driver is needed to create a container.
CDI_SPEC = {
    "cdiVersion": "0.5.0",
    "kind": "nvidia.com/gpu",
    "devices": [{"name": str(i), "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}} for i in range(8)],
    "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}]},
}


@pytest.fixture(scope="module")
def gpu_host_files(two_replicas, sandbox_host):
    nodes = "; ".join(f"[ -e /dev/nvidia{i} ] || mknod -m 666 /dev/nvidia{i} c 195 {i}" for i in range(8))
    spec = json.dumps(CDI_SPEC)
    assert sandbox_host.run(f"{nodes}; [ -e /dev/nvidiactl ] || mknod -m 666 /dev/nvidiactl c 195 255").rc == 0
    assert sandbox_host.run(f"mkdir -p /etc/cdi && cat > /etc/cdi/nvidia.yaml <<'EOF'\n{spec}\nEOF").rc == 0
    yield
    sandbox_host.run("rm -f /etc/cdi/nvidia.yaml /dev/nvidia[0-7] /dev/nvidiactl")


@pytest.mark.parametrize("index", [0, 1, 3])
def test_podman_gives_each_gpu8_replica_its_own_gpus(two_replicas, sandbox_host, served_image, gpu_host_files, index):
    """gpu8 in container mode: replica N's unit command, expanded by systemd from its env file exactly
    as vllm@N.service will, creates a container whose devices are GPUs 2N and 2N+1 only, numbered 0,1
    inside (CUDA_VISIBLE_DEVICES=0,1), never the host's indices."""
    spec = load_stack_spec("gpu8", ROOT).model_dump(exclude_none=True)
    spec["engine"] = {"kind": "container", "image": served_image.reference}
    host_plan = plan(parse_spec(spec)).require_ok()
    replica = host_plan.replicas[index]
    result = run_unit_command(
        sandbox_host,
        host_plan,
        replica,
        served_image.reference,
        "ls /dev; env",  # no $VAR: systemd would expand it before the container's shell
    )
    assert result.rc == 0, result.stderr
    devices = sorted(re.findall(r"^nvidia(\d+)$", result.stdout, re.M))
    assert devices == [str(d) for d in replica.devices]
    assert "nvidiactl" in result.stdout.split()
    assert "CUDA_VISIBLE_DEVICES=0,1" in result.stdout.splitlines()


def run_unit_command(
    sandbox_host, host_plan, replica, image: str, shell: str, ulimits: dict[str, str] | None = None, extra: str = ""
):
    """Replica `replica`'s ExecStart, expanded by systemd from its env file exactly as vllm@N.service will,
    with `/bin/sh -c shell` in the image instead of `vllm serve`: what the container gets. `ulimits` replaces
    the unit's `--ulimit=NAME=...` flags (by NAME) with values this host's root may set; `extra` flags go before
    the image."""
    unit = render(TEMPLATES / "vllm@.service.j2", **unit_context(host_plan)).splitlines()
    exec_start = next(line.removeprefix("ExecStart=+") for line in unit if line.startswith("ExecStart="))
    # The unit's resource limits too, as systemd sets them for podman.
    limits = " ".join(f"-p {shlex.quote(line)}" for line in unit if line.startswith(("LimitNOFILE=", "LimitMEMLOCK=")))
    for flag, value in (ulimits or {}).items():
        assert f"--ulimit={flag}=" in exec_start, (flag, exec_start)
        exec_start = re.sub(rf"--ulimit={flag}=\S+", f"--ulimit={flag}={value}", exec_start)
    name = f"probe{replica.index}"
    probe = exec_start.replace("%i", name).replace(
        f"{image} serve $VLLM_ARGS", f"{extra} --entrypoint=/bin/sh {image} -c {shlex.quote(shell)}"
    )
    env_file = f"/tmp/{name}.env"
    container_env = f"/etc/gemmaserve/replica-{name}.container.env"
    sandbox_host.run(f"cat > {env_file} <<'EOF'\n{render_env(host_plan, replica)}\nEOF")
    sandbox_host.run(f"cat > {container_env} <<'EOF'\n{render_container_env(replica)}\nEOF")
    try:
        # Quoted for the shell: systemd, not bash, expands $VLLM_ARGS, ${CREDENTIALS_DIRECTORY} and the devices.
        return sandbox_host.run(
            f"timeout 120 systemd-run --wait --pipe --quiet --collect -p EnvironmentFile={env_file} "
            f"-p LoadCredential=hf-token:/etc/gemmaserve/hf-token -p User=root {limits} {shlex.join(shlex.split(probe))}"
        )
    finally:
        sandbox_host.run(f"rm -f {env_file} {container_env}")


@pytest.fixture(scope="module")
def amd_host_files(two_replicas, sandbox_host):
    """ROCm's device nodes (amdgpu's kfd and a DRM render node, with their real major numbers' shape)."""
    made = "[ -e /dev/kfd ] || mknod -m 666 /dev/kfd c 235 0; mkdir -p /dev/dri; "
    made += "[ -e /dev/dri/renderD128 ] || mknod -m 666 /dev/dri/renderD128 c 226 128"
    assert sandbox_host.run(made).rc == 0
    yield
    sandbox_host.run("rm -f /dev/kfd /dev/dri/renderD128")


def test_podman_runs_an_amd_replicas_unit_command(two_replicas, sandbox_host, served_image, amd_host_files):
    """mi300x in container mode: the real podman accepts the unit's flags (kfd and the DRM tree, the video
    group, no seccomp filter) and vLLM's process runs as the gemmaserve user in the video group."""
    host_plan = plan(
        parse_spec(
            {
                "model": "31b",
                "accelerator": {"kind": "mi300x", "count": 8},
                "engine": {"kind": "container", "image": served_image.reference},
            }
        )
    ).require_ok()
    result = run_unit_command(
        sandbox_host, host_plan, host_plan.replicas[0], served_image.reference, "id; ls /dev /dev/dri"
    )
    assert result.rc == 0, result.stderr
    assert "uid=" in result.stdout and "(gemmaserve)" in result.stdout and "(video)" in result.stdout
    assert {"kfd", "renderD128"} <= set(result.stdout.split())


def test_podman_runs_a_tpu_replicas_unit_command(two_replicas, sandbox_host, served_image):
    """tpu-v6e4 in container mode: the real podman accepts the unit's flags (the chips' VFIO nodes only, no
    privileges, the host's /dev/shm for the XLA cache) and the plan's environment reaches the process."""
    spec = load_stack_spec("tpu-v6e4", ROOT).model_dump(exclude_none=True)
    spec["engine"] = {"kind": "container", "image": served_image.reference}
    host_plan = plan(parse_spec(spec)).require_ok()
    replica = host_plan.replicas[0]
    # Stand-ins for a TPU VM's nodes (VFIO's container node is misc 10:196; each chip an IOMMU group's node, of
    # the dynamic major vfio registers), so podman finds every --device the unit names.
    vfio = [d for d in replica.container_devices if d.startswith("/dev/vfio/")]
    assert "/dev/vfio/vfio" in vfio and len(vfio) > 1, replica.container_devices
    groups = "; ".join(f"[ -e {d} ] || mknod -m 666 {d} c 240 {d.rsplit('/', 1)[1]}" for d in vfio if d[-1].isdigit())
    made = sandbox_host.run(
        f"mkdir -p /dev/vfio; [ -e /dev/vfio/vfio ] || mknod -m 666 /dev/vfio/vfio c 10 196; {groups}"
    )
    assert made.rc == 0, made.stderr
    # The unit locks memory without limit (the TPU runtime pins host buffers): --ulimit=memlock=-1:-1, which podman
    # passes to crun with its defaults for open files and processes. A TPU VM's root may raise all three; a sandbox
    # host's root may not raise its hard limits (no CAP_SYS_RESOURCE inside systemd-nspawn: crun's setrlimit
    # fails), so the probe asks for this host's own hard limits instead, every other flag as the unit has it.
    assert "--ulimit=memlock=-1:-1" in container_flags(host_plan)
    limits = sandbox_host.file("/proc/1/limits").content_string
    hard = {
        name: re.search(rf"^{label}\s+\S+\s+(\S+)", limits, re.M).group(1).replace("unlimited", "-1")
        for name, label in (("memlock", "Max locked memory"), ("nofile", "Max open files"), ("nproc", "Max processes"))
    }
    ulimits = {"memlock": f"{hard['memlock']}:{hard['memlock']}"}
    probe_flags = " ".join(f"--ulimit={name}={hard[name]}:{hard[name]}" for name in ("nofile", "nproc"))
    marker = "gemmaserve-tpu-probe"
    sandbox_host.run(f"touch /dev/shm/{marker}")
    try:
        result = run_unit_command(
            sandbox_host, host_plan, replica, served_image.reference, "ls /dev/shm; env", ulimits, probe_flags
        )
    finally:
        sandbox_host.run(f"rm -f /dev/shm/{marker}")
    assert result.rc == 0, result.stderr
    assert marker in result.stdout.split()
    for key, value in replica.env.items():
        assert f"{key}={value}" in result.stdout.splitlines()


def test_vllm_bench_runs_from_the_image(two_replicas, sandbox_host):
    """`gemmaserve bench`'s command in container mode, run by the real podman: the image's own `vllm bench
    serve` through HAProxy over TLS (the sandbox's CA under the mounted result directory), the key on stdin."""
    host, host_plan, _, _ = two_replicas
    balancer = sandbox_endpoint(host)
    ca = f"{RESULT_DIR}/ca.pem"
    pem = Path(balancer.credentials.ca_cert).read_text()
    sandbox_host.run(f"mkdir -p {RESULT_DIR} && cat > {ca} <<'EOF'\n{pem}\nEOF")
    command = bench_command(host_plan, "balanced", 8, 4, 1, 2, balancer.root, ca)
    assert command.count(f"{PODMAN} run ") == 1
    rc, _, _ = fleet.run_with_secret(sandbox_host, command, balancer.credentials.api_key)
    assert rc == 0, sandbox_host.run(f"tail -20 {RESULT_DIR}/balanced-c1.log").stdout
    raw = json.loads(sandbox_host.run(f"cat {RESULT_DIR}/balanced-c1.json").stdout)
    assert raw["completed"] == 2 and raw.get("failed", 0) == 0


# --- Artifact Registry credentials ----------------------------------------------------------------

FAKE_METADATA = """
import http.server, json, sys
class Metadata(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path.endswith("/service-accounts/default/token") and self.headers.get("Metadata-Flavor") == "Google"
        self.send_response(200 if ok else 403)
        self.end_headers()
        self.wfile.write(json.dumps({"access_token": "ya29.sandbox-token", "expires_in": 3599}).encode() if ok else b"")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Metadata).serve_forever()
"""


def test_podman_gets_artifact_registry_credentials_from_the_helper(two_replicas, sandbox_host, tmp_path):
    """The real podman reads the auth file the vllm role renders for an Artifact Registry image and asks
    the installed helper, which asks the metadata server for the VM's token (a local stand-in here)."""
    image = "us-docker.pkg.dev/gemmaserve-test/serving/vllm-gemma4@sha256:" + "2" * 64
    helper = Path(__file__).resolve().parents[3] / "roles" / "vllm" / "files" / "registry_credential.py"
    sandbox_host.run(f"cat > {CREDENTIAL_HELPER} <<'EOF'\n{helper.read_text()}\nEOF\nchmod 0755 {CREDENTIAL_HELPER}")
    sandbox_host.run(f"cat > /tmp/registry-auth.json <<'EOF'\n{registry_auth(image)}\nEOF")
    sandbox_host.run(f"cat > /tmp/fake_metadata.py <<'EOF'\n{FAKE_METADATA}\nEOF")
    server = "systemd-run --unit=fake-metadata --collect python3 /tmp/fake_metadata.py 8947"
    assert sandbox_host.run(server).rc == 0
    try:
        env = "GEMMASERVE_METADATA_URL=http://127.0.0.1:8947/computeMetadata/v1"
        wait_until(lambda: sandbox_host.run("curl -s -o /dev/null http://127.0.0.1:8947/").rc == 0, 30, "metadata")
        login = sandbox_host.run(
            f"{env} {PODMAN} login --get-login --authfile /tmp/registry-auth.json us-docker.pkg.dev"
        )
        assert login.rc == 0 and login.stdout.strip() == "oauth2accesstoken", login.stderr
        secret = sandbox_host.run(f"echo us-docker.pkg.dev | {env} {CREDENTIAL_HELPER} get")
        assert json.loads(secret.stdout)["Secret"] == "ya29.sandbox-token"
        # Docker Hub is not Artifact Registry: no helper, no credentials.
        hub = sandbox_host.run(f"{env} {PODMAN} login --get-login --authfile /tmp/registry-auth.json docker.io")
        assert hub.rc != 0
    finally:
        sandbox_host.run(f"systemctl stop fake-metadata; rm -f {CREDENTIAL_HELPER} /tmp/registry-auth.json")
    assert CREDENTIAL_HELPER.endswith(f"docker-credential-{CREDENTIAL_HELPER_NAME}")
