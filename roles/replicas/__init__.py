"""Replicas: the vllm@.service template, one env file per replica, gemmaserve.target, and restarts of
changed replicas one at a time, each followed by a wait for /health."""

from __future__ import annotations

import hashlib
import shlex
from io import StringIO
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Command
from pyinfra.operations import files, server, systemd

from gemmaserve.plan import STATE_DIR, Plan, ReplicaPlan
from roles.batch import UNCHANGED, Snapshot, render
from roles.vllm import ARGCHECK, LIB_DIR

TEMPLATES = Path(__file__).parent / "templates"
CACHE_ENV_KEYS = (
    "VLLM_CACHE_ROOT",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "VLLM_XLA_CACHE_PATH",
    "XDG_CACHE_HOME",
    "TMPDIR",
)

DEFAULTS = {
    "replicas_timeout_start": 1800,  # 31B loads plus graph compilation take many minutes on a cold host
    "replicas_health_timeout": 900,  # seconds a restarted replica may take to report healthy
    "replicas_stagger_checks": 300,  # x 2 s that a replica waits for the previous one to be healthy
    "replicas_nofile": 1048576,
    "replicas_drain_timeout": 600,  # seconds in-flight requests may take to finish before a restart
}


def health_url(serving: Plan, replica: ReplicaPlan) -> str:
    address = serving.spec.serving.bind_address
    return f"http://{'127.0.0.1' if address == '0.0.0.0' else address}:{replica.port}/health"


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


def render_env(serving: Plan, replica: ReplicaPlan) -> str:
    from jinja2 import Template

    previous = serving.replicas[replica.index - 1] if replica.index else None
    env = dict(replica.env)
    env["GEMMASERVE_CACHE_DIRS"] = " ".join(env[k] for k in CACHE_ENV_KEYS if k in env)
    return Template((TEMPLATES / "replica.env.j2").read_text(), trim_blocks=True, lstrip_blocks=True).render(
        replica=type("R", (), {"index": replica.index, "port": replica.port, "env": env}),
        wait_for=health_url(serving, previous) if previous else "none",
        args=replica_args(replica),
    )


def argcheck_command(serving: Plan) -> str:
    """vLLM's own parser, from the same engine that will serve: the venv, or the pinned image."""
    if serving.engine.kind == "wheel":
        return f"{serving.engine.venv}/bin/python {ARGCHECK}"
    return (
        f"/usr/bin/docker run --rm --network=none -v {LIB_DIR}:{LIB_DIR}:ro -v /etc/gemmaserve:/etc/gemmaserve:ro "
        f"--entrypoint python3 {serving.engine.image} {ARGCHECK}"
    )


def docker_run_flags(serving: Plan) -> str:
    """`docker run` flags around the pinned image: host network, devices, shared memory, mounts."""
    vendor = serving.accelerator.vendor
    flags = [
        "--rm",
        "--name vllm-%i",
        "--network=host",
        "--ipc=host",
        "--env-file /etc/gemmaserve/replica-%i.env",
        f"-v {STATE_DIR}:{STATE_DIR}",
        "-v /dev/shm/gemmaserve:/dev/shm/gemmaserve",
        "-v /etc/gemmaserve:/etc/gemmaserve:ro",
    ]
    if serving.spec.secret:
        flags.append("-v ${CREDENTIALS_DIRECTORY}:/run/credentials/vllm@%i.service:ro")
    if vendor == "nvidia":
        flags.append("--gpus device=${CUDA_VISIBLE_DEVICES}")
    elif vendor == "amd":
        flags += ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--security-opt=seccomp=unconfined"]
    elif vendor == "google":
        # Seeds 01/04: TPU containers need the chips (privileged) and the host's /dev/shm for the XLA cache.
        flags += ["--privileged", "-v /dev/shm:/dev/shm"]
    return " ".join(flags)


def device_nodes(serving: Plan) -> list[str]:
    vendor = serving.accelerator.vendor
    if vendor == "nvidia":
        return ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "char-nvidia-frontend"]
    if vendor == "amd":
        return ["/dev/kfd", "char-drm"]
    if vendor == "google":
        return ["/dev/vfio/vfio", "char-vfio", "/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3"]
    return []


def unit_context(serving: Plan, data) -> dict:
    """Everything vllm@.service.j2 is rendered with (`data`: host data with this role's defaults)."""
    fetch_unit = "gemmaserve-hf-token.service" if serving.spec.secret and serving.spec.secret.secret_manager else None
    return {
        "model": serving.model.hf_id,
        "vllm_executable": serving.engine.vllm_executable,
        "credential": serving.token_source_path,
        "fetch_unit": fetch_unit,
        "container": serving.engine.kind == "container",
        "image": serving.engine.image,
        "docker_flags": docker_run_flags(serving),
        "devices": device_nodes(serving),
        "state_dir": STATE_DIR,
        "nofile": data.get("replicas_nofile", DEFAULTS["replicas_nofile"]),
        "timeout_start": data.get("replicas_timeout_start", DEFAULTS["replicas_timeout_start"]),
        "stagger_checks": data.get("replicas_stagger_checks", DEFAULTS["replicas_stagger_checks"]),
    }


@deploy("Run vLLM replicas", data_defaults=DEFAULTS)
def replicas(serving: Plan) -> None:
    unit_path, target_path = "/etc/systemd/system/vllm@.service", "/etc/systemd/system/gemmaserve.target"
    names = [f"vllm@{r.index}.service" for r in serving.replicas]
    now = Snapshot(
        paths=[unit_path, target_path, *(env_path(r.index) for r in serving.replicas)],
        units=["gemmaserve.target", *names],
    )
    unit = now.put(
        name="Install the vllm@.service template",
        dest=unit_path,
        content=render(TEMPLATES / "vllm@.service.j2", **unit_context(serving, host.data)),
    )
    target = now.put(
        name="Install gemmaserve.target",
        dest=target_path,
        content=render(TEMPLATES / "gemmaserve.target.j2", replicas=serving.replicas),
    )
    systemd.daemon_reload(name="Reload systemd units", _if=lambda: unit.did_change() or target.did_change())
    # Enabled, not started here: at boot the target starts every replica; during a deploy replicas are
    # (re)started one at a time below so at most one is down.
    now.service(name="Enable gemmaserve.target", service="gemmaserve.target", enabled=True, running=None)
    _remove_extra_replicas(serving)
    for replica, name in zip(serving.replicas, names, strict=True):
        env_installed = _install_checked_env(serving, replica, now)
        changed = _changed(unit, env_installed)
        # Rolling restart: no new requests for this replica, its running ones finish, then it restarts;
        # the others keep serving (see gemmaserve/haproxy_admin.py).
        admin = f"python3 {LIB_DIR}/haproxy_admin.py"
        server.shell(
            name=f"Drain replica {replica.index} in HAProxy",
            _if=changed,
            commands=[f"{admin} drain vllm/replica{replica.index} --timeout {host.data.replicas_drain_timeout}"],
        )
        # A replica that crash-looped sits in start-limit-hit until its failed state is cleared.
        server.shell(
            name=f"Clear {name}'s failed state",
            commands=[f"systemctl reset-failed {name}"],
            _if=(lambda: True) if now.is_failed(name) else changed,
        )
        restarted = systemd.service(
            name=f"Start or restart {name} (its unit or environment changed)",
            service=name,
            running=True,
            restarted=True,
            _if=changed,
        )
        started = now.service(name=f"Enable {name} and keep it running", service=name, enabled=True, running=True)
        _wait_healthy(serving, replica, _if=_changed(restarted, started))
        server.shell(
            name=f"Return replica {replica.index} to HAProxy",
            _if=changed,
            commands=[f"{admin} ready vllm/replica{replica.index} --timeout 120"],
        )


def env_path(index: int) -> str:
    return f"/etc/gemmaserve/replica-{index}.env"


def _remove_extra_replicas(serving: Plan) -> None:
    """Replicas the plan no longer has (a scale-down): stop and disable them, remove their env files."""
    listed = (
        host.get_fact(Command, "ls /etc/gemmaserve 2>/dev/null | sed -n 's/^replica-\\([0-9]*\\)\\.env$/\\1/p'") or ""
    )
    wanted = {r.index for r in serving.replicas}
    for index in sorted(int(i) for i in listed.split() if i.isdigit() and int(i) not in wanted):
        systemd.service(
            name=f"Stop and disable vllm@{index}.service (no longer planned)",
            service=f"vllm@{index}.service",
            running=False,
            enabled=False,
        )
        files.file(name=f"Remove replica {index}'s environment", path=env_path(index), present=False)


def _install_checked_env(serving: Plan, replica: ReplicaPlan, now: Snapshot):
    """Stage replica-N.env, check its argv with vLLM's own parser exactly as systemd will expand it
    (systemd-run with the same EnvironmentFile and $VLLM_ARGS), and only then install it.

    Returns the installing operation, or UNCHANGED when the live file is already what the plan says.
    """
    content = render_env(serving, replica)
    live = env_path(replica.index)
    state = now.paths.get(live)
    if state and state.kind == "file" and state.sha1 == hashlib.sha1(content.encode()).hexdigest():
        if (state.user, state.group, state.mode) != ("root", "gemmaserve", 0o640):
            # Same flags, wrong owner or mode: mend them; the replica need not restart.
            files.file(
                name=f"Fix the owner and mode of {live}", path=live, user="root", group="gemmaserve", mode="0640"
            )
        return UNCHANGED
    pending = f"{live}.pending"
    files.put(
        name=f"Stage replica {replica.index}'s environment",
        src=StringIO(content),
        dest=pending,
        user="root",
        group="gemmaserve",
        mode="0640",
    )
    return server.shell(
        name=f"Check replica {replica.index}'s vLLM flags with vLLM's own parser, then install them",
        # As the serving user, so whatever vLLM creates while importing (cache dirs) stays its own.
        commands=[
            f"systemd-run --wait --pipe --quiet --collect -p User=gemmaserve -p Group=gemmaserve "
            f"-p EnvironmentFile={pending} {argcheck_command(serving)} -- '$VLLM_ARGS' && mv {pending} {live}"
        ],
    )


def _changed(*ops):
    return lambda: any(op.did_change() for op in ops)


def _wait_healthy(serving: Plan, replica: ReplicaPlan, _if) -> None:
    url = health_url(serving, replica)
    tries = max(1, host.data.replicas_health_timeout // 2)
    server.shell(
        name=f"Wait for replica {replica.index} to be healthy ({url})",
        commands=[
            f"for i in $(seq 1 {tries}); do curl -fsS -o /dev/null {shlex.quote(url)} && exit 0; "
            f"systemctl is-failed --quiet vllm@{replica.index} && break; sleep 2; done; "
            f"echo 'replica {replica.index} not healthy after {host.data.replicas_health_timeout} s' >&2; "
            f"journalctl -u vllm@{replica.index} -n 40 --no-pager >&2; exit 1"
        ],
        _if=_if,
    )
