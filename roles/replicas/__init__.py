"""Replicas: the vllm@.service template, one env file per replica, gemmaserve.target, and restarts of
changed replicas one at a time, each drained in HAProxy first and followed by a wait for /health."""

from __future__ import annotations

import math
import shlex
from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.facts.server import Command
from pyinfra.operations import files, server, systemd

from gemmaserve.plan import CONTAINER_RUNTIME, SHM_CACHE_ROOT, STATE_DIR, Plan, ReplicaPlan
from roles._lib.facts import HostState, PathState
from roles._lib.managed import install_programs, managed_directory, managed_file, managed_service, same_content
from roles._lib.programs import (
    ARGCHECK,
    GPU_PREFLIGHT,
    HAPROXY_ADMIN,
    LIB_DIR,
    STORAGE_EMULATOR_KEY,
    installed_path,
)
from roles._lib.render import render
from roles._lib.settings import RoleSettings
from roles.weights import marker_path as weights_marker
from roles.weights import unit_name as weights_unit

TEMPLATES = Path(__file__).parent / "templates"
READY = installed_path("replica_ready.py")
UNIT_PATH = "/etc/systemd/system/vllm@.service"
TARGET_PATH = "/etc/systemd/system/gemmaserve.target"
CACHE_ENV_KEYS = (
    "VLLM_CACHE_ROOT",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "VLLM_XLA_CACHE_PATH",
    "XDG_CACHE_HOME",
    "TMPDIR",
)


class Settings(RoleSettings):
    prefix = "replicas_"
    renamed = {"stagger_checks": "write replicas_stagger_timeout, in seconds (it counted 2 s checks: double the value)"}
    # 31B loads plus graph compilation take many minutes on a cold host.
    timeout_start: int = 1800
    # Seconds a restarted replica may take to report healthy.
    health_timeout: int = 900
    # Seconds a replica waits for the previous one to be healthy (checked every 2 s), then starts anyway.
    stagger_timeout: int = 600
    nofile: int = 1048576
    # Seconds in-flight requests may take to finish before a restart.
    drain_timeout: int = 600


# The unit checks the previous replica's health this often while it waits (templates/vllm@.service.j2).
STAGGER_CHECK_S = 2


def env_path(index: int) -> str:
    return f"/etc/gemmaserve/replica-{index}.env"


def affinity_dropin_path(index: int) -> str:
    return f"/etc/systemd/system/vllm@{index}.service.d/gemmaserve-affinity.conf"


def affinity_dropin(replica: ReplicaPlan) -> str | None:
    """CPUs and memory of the NUMA node the replica's GPUs hang off (gemmaserve.topology), or None."""
    if not replica.cpu_affinity:
        return None
    lines = [
        "# Rendered by gemmaserve (roles/replicas): the CPUs and NUMA node local to this replica's GPUs.",
        "[Service]",
    ]
    lines.append(f"CPUAffinity={replica.cpu_affinity.replace(',', ' ')}")
    if replica.numa_node is not None:
        lines += ["NUMAPolicy=bind", f"NUMAMask={replica.numa_node}"]
    return "\n".join(lines) + "\n"


def container_env_path(index: int | str) -> str:
    """The container's environment (podman --env-file): the plan's, and nothing of the unit's."""
    return f"/etc/gemmaserve/replica-{index}.container.env"


def replica_args(replica: ReplicaPlan) -> str:
    """argv after `vllm serve`, as systemd will word-split $VLLM_ARGS.

    systemd unquotes the words it splits $VLLM_ARGS into, so JSON's double quotes are escaped; the
    env file single-quotes the whole value so it keeps those backslashes. No argument may hold
    whitespace (the split), a single quote or backslash (the quoting) or $ and % (systemd expansions).
    """
    args = replica.argv[2:]
    bad = [a for a in args if not a or any(c.isspace() for c in a) or set(a) & set("'$%\\")]
    if bad:
        raise ValueError(f"replica {replica.index}: arguments {bad} cannot pass through systemd word splitting")
    return " ".join(a.replace('"', '\\"') for a in args)


def emulator_env(plan: Plan, emulator: str | None) -> dict[str, str]:
    """A GCS API emulator for the Run:ai streamer (the sandbox's bucket): its Python side reads
    STORAGE_EMULATOR_HOST, its C++ client (google-cloud-cpp) CLOUD_STORAGE_EMULATOR_ENDPOINT."""
    if not emulator or plan.weights.mode != "stream":
        return {}
    return {
        "STORAGE_EMULATOR_HOST": emulator,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": emulator,
        "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS": "true",
    }


def render_env(plan: Plan, replica: ReplicaPlan, emulator: str | None = None) -> str:
    """replica-N.env, the unit's environment: with a venv, the plan's environment for vLLM too; under
    podman only what the unit's own commands use, so podman never runs with vLLM's TMPDIR or caches."""
    previous = plan.replicas[replica.index - 1] if replica.index else None
    container = plan.engine.kind == "container"
    env = {} if container else {**replica.env, **emulator_env(plan, emulator)}
    env["GEMMASERVE_CACHE_DIRS"] = " ".join(replica.env[k] for k in CACHE_ENV_KEYS if k in replica.env)
    if container:
        env["GEMMASERVE_CONTAINER_DEVICES"] = " ".join(f"--device={d}" for d in replica.container_devices)
        if plan.accelerator.vendor == "nvidia":
            # The GPU preflight runs on the host, before podman: it checks the host's GPUs of this replica
            # (CUDA_VISIBLE_DEVICES is the container's own numbering, 0..tp-1) in PCI bus order.
            env["GEMMASERVE_HOST_GPUS"] = ",".join(map(str, replica.devices))
            env["CUDA_DEVICE_ORDER"] = replica.env["CUDA_DEVICE_ORDER"]
    return render(
        TEMPLATES / "replica.env.j2",
        index=replica.index,
        port=replica.port,
        env=env,
        wait_for=previous.health_url if previous else "none",
        health_url=replica.health_url,
        args=replica_args(replica),
    )


def render_container_env(replica: ReplicaPlan, extra: dict[str, str] | None = None) -> str:
    """replica-N.container.env: the plan's environment for vLLM inside the container (plus `extra`)."""
    lines = [
        f"# Rendered by gemmaserve (roles/replicas) from the plan: replica {replica.index}'s container environment.",
        "# No secrets here: the HF token is a systemd credential, mounted read-only (HF_TOKEN_PATH).",
        *(f"{key}={value}" for key, value in {**replica.env, **(extra or {})}.items()),
    ]
    return "\n".join(lines) + "\n"


def container_flags(plan: Plan) -> list[str]:
    """What every `podman run` of the pinned image gets, the serving container and the flag check alike:
    host network and IPC, the host's state, caches and config, vLLM as the gemmaserve user with no
    capabilities on a read-only root file system, and the accelerator's own needs."""
    vendor = plan.accelerator.vendor
    flags = [
        # Run by digest from local storage; the vllm role loaded or pulled it before any replica changed.
        "--pull=never",
        # No cgroup of its own: the container stays in the unit's, where systemd accounts for and stops it
        # (and a systemd-nspawn host with cgroup v1 allows no other).
        "--cgroups=disabled",
        "--network=host",
        "--ipc=host",
        f"-v {STATE_DIR}:{STATE_DIR}",
        f"-v {SHM_CACHE_ROOT}:{SHM_CACHE_ROOT}",
        "-v /etc/gemmaserve:/etc/gemmaserve:ro",
        f"-v {LIB_DIR}:{LIB_DIR}:ro",
    ]
    # The host's user database names the gemmaserve user inside the container, so its files on the
    # host's volumes keep one owner in both engines.
    confined = [
        "--user=gemmaserve:gemmaserve",
        "-v /etc/passwd:/etc/passwd:ro",
        "-v /etc/group:/etc/group:ro",
        "--cap-drop=all",
        "--security-opt=no-new-privileges",
        "--read-only",
    ]
    if vendor == "google":
        # vLLM's recipe runs TPU containers --privileged (https://docs.vllm.ai/projects/recipes/en/latest/Google/Gemma4.html);
        # what they need of it is the chips (each replica's --device list: the plan's container_devices), memory
        # they may pin for DMA (vfio_pin_pages_remote counts it against RLIMIT_MEMLOCK, as the unit's own
        # LimitMEMLOCK) and the host's /dev/shm for the XLA cache. Confined like the other vendors: the gemmaserve
        # user opens the chips here as it does under the wheel engine's unit (User=gemmaserve), with no capability.
        return [*flags, *confined, "--ulimit=memlock=-1:-1", "-v /dev/shm:/dev/shm"]
    if vendor == "amd":
        # ROCm's device nodes belong to the video and render groups (the rocm role makes gemmaserve a member
        # of both, which the mounted /etc/group carries in); no seccomp filter for its kernel driver's
        # ioctls (vLLM's ROCm docs).
        return [*flags, *confined, "--group-add=video", "--security-opt=seccomp=unconfined"]
    return [*flags, *confined]


def serving_container_flags(plan: Plan) -> str:
    """`podman run` flags of vllm@.service: the shared ones, plus a name, the replica's environment file,
    an init that passes SIGTERM on to vLLM, and the HF token credential; each replica adds its devices."""
    flags = ["--rm", "--name=vllm-%i", "--init", "--log-driver=passthrough", *container_flags(plan)]
    flags.append(f"--env-file={container_env_path('%i')}")
    if plan.spec.secret:
        flags.append("-v ${CREDENTIALS_DIRECTORY}:/run/credentials/vllm@%i.service:ro")
    return " ".join(flags)


def argcheck_command(plan: Plan) -> str:
    """vLLM's own parser, from the same engine that will serve: the venv, or the pinned image."""
    if plan.engine.kind == "wheel":
        return f"{plan.engine.venv}/bin/python {ARGCHECK}"
    flags = " ".join(["--rm", *container_flags(plan)])
    return f"{CONTAINER_RUNTIME} run {flags} --entrypoint=python3 {plan.engine.image} {ARGCHECK}"


def argcheck_user(plan: Plan) -> str:
    """Who runs the check: the serving user for a venv; root for podman (vLLM inside is --user)."""
    return "gemmaserve" if plan.engine.kind == "wheel" else "root"


def device_nodes(plan: Plan) -> list[str]:
    """DeviceAllow= entries. Device classes (char-NAME) are the names in /proc/devices, which systemd
    resolves when the unit starts, so the modules must be loaded by then (the driver roles' units)."""
    vendor = plan.accelerator.vendor
    if vendor == "nvidia":
        # nvidia.ko registers major 195 as "nvidia" (minors 0-254, /dev/nvidiaN) and "nvidiactl" (255); the
        # name "nvidia-frontend" was last registered by the 535 branch (kernel-open/nvidia/nv.c at tags
        # 545.23.06..580.95.05 of NVIDIA/open-gpu-kernel-modules). systemd allows the whole major per name.
        # nvidia-uvm.ko takes a dynamic major named "nvidia-uvm" (kernel-open/nvidia-uvm/uvm.c). A MIG instance
        # is opened through /dev/nvidia-caps/nvidia-capN, nvidia.ko's "nvidia-caps" major (kernel-open/nvidia/
        # nv-caps.c; NVIDIA's MIG user guide, "Device Nodes and Capabilities").
        return ["char-nvidia", "char-nvidia-uvm", "char-nvidia-caps"]
    if vendor == "amd":
        # amdkfd registers "kfd" (drivers/gpu/drm/amd/amdkfd/kfd_chardev.c), DRM registers major 226 as "drm".
        return ["char-kfd", "char-drm"]
    if vendor == "google":
        return ["/dev/vfio/vfio", "char-vfio", "/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3"]
    return []


def driver_units(plan: Plan) -> dict[str, list[str]]:
    """Units a replica starts after (and which of them it cannot run without)."""
    if plan.accelerator.vendor != "nvidia":
        return {"after": [], "requires": [], "wants": []}
    devices = "gemmaserve-nvidia-devices.service"
    # Fabric manager must have trained the NVSwitch fabric first, or CUDA returns error 802 and the replica
    # crash-loops into its start limit. Where it is not installed (PCIe hosts) the Wants= is a no-op.
    daemons = ["nvidia-persistenced.service", "nvidia-fabricmanager.service"]
    return {"after": [devices, *daemons], "requires": [devices], "wants": daemons}


def replica_needs_no_metadata(plan: Plan) -> bool:
    """Whether vLLM can run with the metadata server out of reach: not where it streams its weights from the
    bucket itself (the Run:ai streamer takes the host account's token from it), nor on TPU (vLLM reads the
    chips' topology from its tpu-env attribute: github.com/vllm-project/vllm/issues/9538), nor where it
    downloads from the Hugging Face hub (a Debian VM on Google Cloud resolves names through the same address,
    169.254.169.254: cloud.google.com/compute/docs/internal-dns). Weights pulled by the weights unit, or a
    local directory, leave vLLM offline (HF_HUB_OFFLINE)."""
    return plan.weights.mode in ("pull", "local") and plan.accelerator.vendor != "google"


def unit_context(plan: Plan, settings: Settings = Settings()) -> dict:
    """Everything vllm@.service.j2 is rendered with."""
    fetch_unit = "gemmaserve-hf-token.service" if plan.spec.secret and plan.spec.secret.secret_manager else None
    container = plan.engine.kind == "container"
    shutdown = plan.spec.serving.shutdown_timeout
    return {
        "model": plan.model.hf_id,
        "vllm_executable": plan.engine.vllm_executable,
        "credential": plan.token_source_path,
        "fetch_unit": fetch_unit,
        "container": container,
        "runtime": CONTAINER_RUNTIME,
        "image": plan.engine.image,
        "container_flags": serving_container_flags(plan) if container else "",
        "devices": device_nodes(plan),
        "driver_units": driver_units(plan),
        # The GPUs are checked (ECC, row remaps, MIG, fabric state, driver match) before vLLM starts, with
        # full privileges ("+"), so a sick GPU keeps the replica out of the balancer.
        "preflight": f"/usr/bin/python3 {GPU_PREFLIGHT}" if plan.accelerator.vendor == "nvidia" else None,
        # TPU chips are VFIO devices whose DMA buffers are pinned against RLIMIT_MEMLOCK (the kernel's
        # vfio_pin_pages_remote refuses past it); systemd's default is a few MiB.
        "memlock": "infinity" if plan.accelerator.vendor == "google" else None,
        "deny_metadata": replica_needs_no_metadata(plan),
        "state_dir": STATE_DIR,
        "haproxy_admin": HAPROXY_ADMIN,
        "shutdown_timeout": shutdown,
        # HAProxy's drain, then vLLM's own (each at most shutdown_timeout), then time to exit.
        "stop_timeout": 2 * shutdown + 30,
        "nofile": settings.nofile,
        "timeout_start": settings.timeout_start,
        "stagger_checks": math.ceil(settings.stagger_timeout / STAGGER_CHECK_S),
        "stagger_check_s": STAGGER_CHECK_S,
        "weights_unit": weights_unit(plan),
        "weights_marker": weights_marker(plan),
        "ready_program": READY,
        "health_url": "$GEMMASERVE_HEALTH_URL",
    }


@deploy("Run vLLM replicas", data_defaults=Settings.defaults())
def replicas(plan: Plan) -> None:
    settings = Settings.from_host(host)
    names = [r.unit for r in plan.replicas]
    dropins = {r.index: affinity_dropin_path(r.index) for r in plan.replicas}
    container = plan.engine.kind == "container"
    container_envs = {r.index: container_env_path(r.index) for r in plan.replicas} if container else {}
    now = HostState(
        host,
        paths=[
            UNIT_PATH,
            TARGET_PATH,
            LIB_DIR,
            READY,
            *(env_path(r.index) for r in plan.replicas),
            *container_envs.values(),
            *dropins.values(),
            *(str(Path(p).parent) for p in dropins.values()),
        ],
        units=["gemmaserve.target", *names],
    )
    # The readiness reporter (loading / compiling / ready).
    install_programs("replicas", now)
    unit_text = render(TEMPLATES / "vllm@.service.j2", **unit_context(plan, settings))
    # First vLLM's own parser, inside the engine the new unit will run (the venv or the pinned image),
    # for every replica whose flags or engine change: a rejected flag or an engine that cannot run at
    # all stops the deploy here, before a unit, an environment or a running replica changes.
    check, check_user = argcheck_command(plan), argcheck_user(plan)
    engine = plan.engine.image if plan.engine.kind == "container" else plan.engine.venv
    envs = {}
    for replica in plan.replicas:
        live, content = env_path(replica.index), render_env(plan, replica, host.data.get(STORAGE_EMULATOR_KEY))
        env_owner(name=f"Fix the owner and mode of {live}", path=live, content=content, current=now.path(live))
        envs[replica.index] = checked_env(
            name=f"Check replica {replica.index}'s vLLM flags with vLLM's own parser, then install them",
            path=live,
            content=content,
            check=check,
            user=check_user,
            replica=replica.index,
            engine=engine,
            unit_changes=not same_content(now.path(UNIT_PATH), unit_text),
            current=now.path(live),
        )
    # Under podman, the plan's environment goes to the container alone.
    container_env = {
        replica.index: managed_file(
            name=f"Install replica {replica.index}'s container environment",
            dest=container_envs[replica.index],
            content=render_container_env(replica, emulator_env(plan, host.data.get(STORAGE_EMULATOR_KEY))),
            group="gemmaserve",
            mode="0640",
            current=now.path(container_envs[replica.index]),
        )
        for replica in plan.replicas
        if container
    }
    unit = managed_file(
        name="Install the vllm@.service template", dest=UNIT_PATH, content=unit_text, current=now.path(UNIT_PATH)
    )
    target = managed_file(
        name="Install gemmaserve.target",
        dest=TARGET_PATH,
        content=render(TEMPLATES / "gemmaserve.target.j2", replicas=plan.replicas),
        current=now.path(TARGET_PATH),
    )
    systemd.daemon_reload(name="Reload systemd units", _if=lambda: unit.did_change() or target.did_change())
    # Enabled, not started here: at boot the target starts every replica; during a deploy replicas are
    # (re)started one at a time below so at most one is down.
    managed_service(
        name="Enable gemmaserve.target",
        service="gemmaserve.target",
        current=now.unit("gemmaserve.target"),
        running=None,
    )
    _remove_extra_replicas(plan)
    for replica in plan.replicas:
        affinity = _affinity(
            replica, now.path(dropins[replica.index]), now.path(str(Path(dropins[replica.index]).parent))
        )

        def changed(env=envs[replica.index], other=container_env.get(replica.index), affinity=affinity) -> bool:
            return (
                unit.did_change()
                or env.did_change()
                or (other is not None and other.did_change())
                or (affinity is not None and affinity.did_change())
            )

        # Rolling restart: no new requests for this replica, its running ones finish, then it restarts;
        # the others keep serving (roles/router/files/haproxy_admin.py).
        admin = f"python3 {HAPROXY_ADMIN}"
        server_name = f"vllm/replica{replica.index}"
        server.shell(
            name=f"Drain replica {replica.index} in HAProxy",
            commands=[f"{admin} drain {server_name} --timeout {settings.drain_timeout}"],
            _if=changed,
        )
        restarted = restart_replica(
            name=f"Start or restart {replica.unit} (its unit or environment changed)", service=replica.unit, _if=changed
        )
        started = managed_service(
            name=f"Enable {replica.unit} and keep it running", service=replica.unit, current=now.unit(replica.unit)
        )
        _wait_healthy(replica, settings, _if=lambda r=restarted, s=started: r.did_change() or s.did_change())
        server.shell(
            name=f"Return replica {replica.index} to HAProxy",
            commands=[f"{admin} ready {server_name} --timeout 120"],
            _if=changed,
        )


def _affinity(replica: ReplicaPlan, current: PathState, folder: PathState):
    """The replica's CPU/NUMA drop-in, kept in step with the plan (removed when the plan has none)."""
    path, content = affinity_dropin_path(replica.index), affinity_dropin(replica)
    if content is None:
        if current.kind == "file":
            removed = files.file(name=f"Remove {path} (no CPU affinity planned)", path=path, present=False)
            systemd.daemon_reload(name="Reload systemd units", _if=removed.did_change)
            return removed
        return None
    managed_directory(name=f"Create {Path(path).parent}", path=str(Path(path).parent), current=folder)
    written = managed_file(
        name=f"Pin replica {replica.index} to its GPUs' CPUs and NUMA node", dest=path, content=content, current=current
    )
    systemd.daemon_reload(name="Reload systemd units", _if=written.did_change)
    return written


def _owned_env(current: PathState) -> bool:
    return (current.user, current.group, current.mode) == ("root", "gemmaserve", 0o640)


@operation()
def env_owner(path: str, content: str, current: PathState):
    """The same flags with the wrong owner or mode: mend them; the replica need not restart."""
    if same_content(current, content) and not _owned_env(current):
        yield from files.file._inner(path=path, user="root", group="gemmaserve", mode="0640")
    else:
        host.noop(f"{path}: owner and mode are right, or its content changes below")


@operation()
def checked_env(
    path: str, content: str, check: str, user: str, replica: int, engine: str, unit_changes: bool, current: PathState
):
    """Stage replica-N.env, check its argv with vLLM's own parser exactly as systemd will expand it
    (systemd-run with the same EnvironmentFile and $VLLM_ARGS), and only then install it. With the same
    flags but a new unit (another image or venv), check them in the new engine all the same."""
    if same_content(current, content) and not unit_changes:
        host.noop(f"{path} already holds the planned flags")
        return
    failed = f"replica {replica} (vllm@{replica}): vLLM in {engine} rejected its flags or could not run; the running replica was not touched"
    staged = path if same_content(current, content) else f"{path}.pending"
    if staged != path:
        yield from files.put._inner(src=StringIO(content), dest=staged, user="root", group="gemmaserve", mode="0640")
    # As the serving user (a venv) so whatever vLLM creates while importing stays its own; podman runs
    # as root and starts vLLM as that user inside the image.
    install = f" && mv {staged} {path}" if staged != path else ""
    cleanup = f"rm -f {staged}; " if staged != path else ""
    yield (
        f"systemd-run --wait --pipe --quiet --collect -p User={user} -p Group={user} "
        f"-p EnvironmentFile={staged} {check} -- '$VLLM_ARGS'{install} "
        f"|| {{ {cleanup}echo {shlex.quote(failed)} >&2; exit 1; }}"
    )


@operation(is_idempotent=False)
def restart_replica(service: str):
    """Restart a replica whose unit or environment changed; a crash-looped one is cleared of its failed state."""
    yield f"systemctl reset-failed {service} 2>/dev/null || true"
    yield from systemd.service._inner(service=service, running=True, restarted=True)


def _remove_extra_replicas(plan: Plan) -> None:
    """Replicas the plan no longer has (a scale-down): stop and disable them, remove their env files."""
    listed = (
        host.get_fact(Command, "ls /etc/gemmaserve 2>/dev/null | sed -n 's/^replica-\\([0-9]*\\)\\.env$/\\1/p'") or ""
    )
    wanted = {r.index for r in plan.replicas}
    for index in sorted(int(i) for i in listed.split() if i.isdigit() and int(i) not in wanted):
        systemd.service(
            name=f"Stop and disable vllm@{index}.service (no longer planned)",
            service=f"vllm@{index}.service",
            running=False,
            enabled=False,
        )
        files.file(name=f"Remove replica {index}'s environment", path=env_path(index), present=False)
        files.file(
            name=f"Remove replica {index}'s container environment", path=container_env_path(index), present=False
        )


def _wait_healthy(replica: ReplicaPlan, settings: Settings, _if) -> None:
    url = replica.health_url
    tries = max(1, settings.health_timeout // 2)
    server.shell(
        name=f"Wait for replica {replica.index} to be healthy ({url})",
        commands=[
            f"for i in $(seq 1 {tries}); do curl -fsS -o /dev/null {shlex.quote(url)} && exit 0; "
            f"systemctl is-failed --quiet vllm@{replica.index} && break; sleep 2; done; "
            f"echo 'replica {replica.index} not healthy after {settings.health_timeout} s' >&2; "
            f"journalctl -u vllm@{replica.index} -n 40 --no-pager >&2; exit 1"
        ],
        _if=_if,
    )
