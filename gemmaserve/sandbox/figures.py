"""The sandbox's own figures, measured by `gemmaserve sandbox bench` (an endpoint's load test, `gemmaserve bench`,
is gemmaserve/ops/bench.py): rootfs build, cached unpack, host up, boot, idle RSS, down; and with a deploy:
pyinfra deploy, no-op redeploy, time to first token after a cold and a warm replica restart; the
same for both engines, the pinned venv and the locally built image under podman; and both routing policies
under one multi-turn workload on a host of two replicas."""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import yaml

from gemmaserve.ops import conversations
from gemmaserve.sandbox import lifecycle, machine, rootfs, state

Log = Callable[[str], None]


def measure(cold: bool = False, log: Log = print) -> dict[str, float]:
    """Bring one throwaway host (first free index from 101) up and down, timing each phase.

    cold=True deletes the cached rootfs first, so the debootstrap build is timed too (~70-130 s).
    """
    figures: dict[str, float] = {}
    tarball = rootfs.CACHE_DIR / f"rootfs-{rootfs.SUITE}-{rootfs.cache_key(rootfs.outer_apt_sources())}.tar.zst"
    if cold:
        tarball.unlink(missing_ok=True)
    started = time.monotonic()
    rootfs.cached_rootfs(log)
    if cold:
        figures["rootfs_build_cold_s"] = time.monotonic() - started
    figures["rootfs_cache_mb"] = tarball.stat().st_size / 1e6
    scratch = rootfs.CACHE_DIR / "bench-unpack"
    started = time.monotonic()
    rootfs.unpack_rootfs(tarball, scratch)
    figures["rootfs_unpack_cached_s"] = time.monotonic() - started
    machine.remove_tree(scratch)

    [host] = lifecycle.up_new_hosts(1, log=log)
    try:
        timings = host.boot_timings
        figures["host_rootfs_ready_s"] = timings["rootfs_s"]
        figures["host_boot_to_ssh_s"] = timings["boot_s"]
        figures["host_up_s"] = timings["up_s"]
        time.sleep(5)  # let boot-time jobs finish before reading the idle footprint
        figures["host_idle_rss_mb"] = machine.host_rss_bytes(host) / 2**20
    finally:
        started = time.monotonic()
        lifecycle.down([host.name], log=log)
        figures["host_down_s"] = time.monotonic() - started
    return figures


def _first_token_after(host: state.Host, restart: str, log: Log, timeout: float = 600) -> float:
    """Seconds from running `restart` on the host until a streamed chat completion yields a token."""
    import openai

    from gemmaserve.ops.endpoint import EndpointError
    from gemmaserve.sandbox import credentials

    endpoint = credentials.endpoint(host)
    # No retries: a refused request is retried by the loop below, once /health answers again.
    with endpoint.openai(max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        started = time.monotonic()
        machine.in_host(host, "/bin/sh", "-c", restart, timeout=120)
        while time.monotonic() - started < timeout:
            try:
                status, _ = endpoint.request("/health", timeout=2)
                if status == 200:
                    first = None
                    stream = client.chat.completions.create(
                        model=model, stream=True, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
                    )
                    with stream:
                        # The first chunk with a content field, as these figures have always been taken. Read to
                        # the end: a stream left open when the next restart stops vLLM holds its HTTP server (and
                        # the restart) until systemd's stop timeout.
                        for chunk in stream:
                            if first is None and any(choice.delta.content is not None for choice in chunk.choices):
                                first = time.monotonic() - started
                    if first is not None:
                        return first
            except (EndpointError, openai.APIError):
                pass
            time.sleep(0.5)
    raise RuntimeError(f"no token from {endpoint.base_url} within {timeout:.0f} s of `{restart}`")


def _busy_cpu_s() -> float:
    """Machine-wide busy CPU seconds so far (user, nice, system, irq, softirq) from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def _pyinfra(names: list[str], data: Path | None = None) -> tuple[float, float]:
    """Deploy deploy.py to the named sandbox hosts in one pyinfra run: (wall seconds, busy CPU seconds)."""
    from gemmaserve.ops import fleet
    from gemmaserve.sandbox.profile import OVERRIDE_ENV

    cpu = _busy_cpu_s()
    run = fleet.run_pyinfra(limit=names, env={OVERRIDE_ENV: str(data) if data else None})
    if not run.ok:
        raise RuntimeError(f"deploy to {names} failed:\n" + run.output[-3000:])
    return run.seconds, _busy_cpu_s() - cpu


# --no-block: the unit is activating until /health answers (replica_ready.py); the timing starts at the start job.
# Both stop first and wait for it: a `restart --no-block` returns while the old vLLM is still draining (its
# ExecStop takes it out of HAProxy and waits), so the first request could be answered by the old process.
COLD = "systemctl stop vllm@0 && rm -rf /dev/shm/gemmaserve/* && systemctl start --no-block vllm@0"
WARM = "systemctl stop vllm@0 && systemctl start --no-block vllm@0"


def measure_deploy(log: Log = print) -> dict[str, float]:
    """Deploy the demo profile to a throwaway host with the real pyinfra CLI and time serving.

    Restarts are timed twice: on the demo profile (eager: nothing compiled, so the caches hold little)
    and after redeploying with torch.compile on, where the compile cache on /dev/shm is what a warm
    restart reuses and a cold one (caches wiped, as after a reboot with nothing restored) rebuilds.
    """
    from gemmaserve.sandbox.demo import ensure_engine_and_model
    from gemmaserve.sandbox.profile import DEFAULT_DATA

    ensure_engine_and_model()
    figures: dict[str, float] = {}
    started = time.monotonic()
    [host] = lifecycle.up_new_hosts(1, log=log)
    figures["host_up_s"] = time.monotonic() - started
    compiled = rootfs.CACHE_DIR / "bench-compiled.yaml"
    compiled.write_text(
        yaml.safe_dump({"gemmaserve_workload": {**DEFAULT_DATA["gemmaserve_workload"], "enforce_eager": False}})
    )
    try:
        for figure in ("deploy_s", "noop_redeploy_s"):
            figures[figure], _ = _pyinfra([host.name])
            log(f"{figure}: {figures[figure]:.1f} s")
        for mode in ("eager", "compiled"):
            if mode == "compiled":
                figures["redeploy_to_compiled_s"], _ = _pyinfra([host.name], compiled)
                log(f"redeploy_to_compiled_s: {figures['redeploy_to_compiled_s']:.1f} s (g++ and a first compile)")
            cold = _first_token_after(host, COLD, log)
            warm = _first_token_after(host, WARM, log)
            figures[f"{mode}_first_token_after_cold_restart_s"] = cold
            figures[f"{mode}_first_token_after_warm_restart_s"] = warm
            figures[f"{mode}_warm_over_cold"] = warm / cold
            log(f"{mode}: first token {cold:.1f} s after a cold restart, {warm:.1f} s after a warm one")
    finally:
        compiled.unlink(missing_ok=True)
        lifecycle.down([host.name], log=log)
    return figures


def measure_engines(log: Log = print) -> dict[str, float]:
    """The demo profile served by each engine on a fresh host of this machine, one after the other:
    image build (or the cached build's recorded time), first deploy, no-op redeploy, first token after
    a cold and a warm restart."""
    from gemmaserve.sandbox.demo import ensure_engine_and_model, ensure_image
    from gemmaserve.sandbox.profile import container_engine_data

    ensure_engine_and_model()
    started = time.monotonic()
    built = ensure_image()
    figures: dict[str, float] = {
        "image_build_s": built.build_s + built.save_s,
        "image_ensure_now_s": time.monotonic() - started,
        "image_archive_mb": built.archive_bytes / 1e6,
    }
    for engine, data in (("wheel", {}), ("container", container_engine_data(built.reference, built.archive))):
        [host] = lifecycle.up_new_hosts(1, log=log)
        state.set_host_data(host.name, data)
        try:
            figures[f"{engine}_first_deploy_s"], _ = _pyinfra([host.name])
            figures[f"{engine}_noop_redeploy_s"], _ = _pyinfra([host.name])
            cold = _first_token_after(host, COLD, log)
            warm = _first_token_after(host, WARM, log)
            figures[f"{engine}_first_token_after_cold_restart_s"] = cold
            figures[f"{engine}_first_token_after_warm_restart_s"] = warm
            log(
                f"{engine}: deploy {figures[f'{engine}_first_deploy_s']:.1f} s, no-op "
                f"{figures[f'{engine}_noop_redeploy_s']:.1f} s, first token {cold:.1f} s after a cold restart, "
                f"{warm:.1f} s after a warm one"
            )
        finally:
            lifecycle.down([host.name], log=log)
    return figures


def measure_fleet(size: int = 4, log: Log = print) -> dict[str, float]:
    """Deploy one fresh host, then `size` fresh hosts in one pyinfra run: how deploys scale with hosts.

    Sandbox hosts share this machine's cores, so the figures include the CPU floor: the busy CPU
    seconds the run used divided by the cores; no orchestration can finish below it here.
    """
    from gemmaserve.sandbox.demo import ensure_engine_and_model

    ensure_engine_and_model()
    names = [h.name for h in lifecycle.up_new_hosts(size + 1, log=log)]
    cores = os.cpu_count() or 1
    figures: dict[str, float] = {"cores": cores}
    try:
        for label, group in (("1_host", names[:1]), (f"{size}_hosts", names[1:])):
            wall, cpu = _pyinfra(group)
            figures[f"deploy_{label}_s"], figures[f"deploy_{label}_cpu_s"] = wall, cpu
            figures[f"deploy_{label}_cpu_floor_s"] = cpu / cores
            log(f"deploy {label}: {wall:.1f} s, {cpu:.0f} CPU s (floor on {cores} cores: {cpu / cores:.1f} s)")
        figures[f"{size}_hosts_over_1"] = figures[f"deploy_{size}_hosts_s"] / figures["deploy_1_host_s"]
        # Above 1.0 only by what orchestration adds on top of the work the hosts' CPUs must do.
        figures[f"{size}_hosts_over_max_1_host_and_cpu_floor"] = figures[f"deploy_{size}_hosts_s"] / max(
            figures["deploy_1_host_s"], figures[f"deploy_{size}_hosts_cpu_floor_s"]
        )
    finally:
        lifecycle.down(names, log=log)
    return figures


def print_figures(figures: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("figure", "value", title="sandbox figures")
    for name, value in figures.items():
        table.add_row(name, f"{value:.2f}" if value < 10 else f"{value:.1f}")
    Console().print(table)


def sequential_read_mib_s(path: Path, chunk: int = 16 * 2**20) -> float:
    """The disk's own sequential read bandwidth for `path`, bypassing the page cache (O_DIRECT)."""
    import mmap

    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    started, total = time.monotonic(), 0
    try:
        while count := os.readv(fd, [buffer]):
            total += count
    finally:
        os.close(fd)
    return total / 2**20 / (time.monotonic() - started)


def _drop_page_cache() -> None:
    """So a start reads its weights from disk, not from memory (as on a freshly booted host)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _deploy_with(host: state.Host, data: dict, log: Log) -> float:
    override = rootfs.CACHE_DIR / f"bench-weights-{host.name}.yaml"
    override.write_text(yaml.safe_dump(data))
    try:
        wall, _ = _pyinfra([host.name], override)
    finally:
        override.unlink(missing_ok=True)
    return wall


def measure_weights(log: Log = print) -> dict[str, float]:
    """Cold start with a ≥ 1 GB test model: first token after `systemctl start` with the weights already
    local, pulled from the sandbox's bucket, and streamed; next to the floors the disk and the bucket set.
    Then two hosts with torch.compile on: the second starts warm from the bucket's compile cache vs cold."""
    from gemmaserve.sandbox import bucket
    from gemmaserve.sandbox.demo import ensure_engine_and_model
    from gemmaserve.sandbox.tiny_model import ensure_test_model

    ensure_engine_and_model()
    model_dir, built = ensure_test_model(MODEL_1G_DIR, "1g")
    log(f"1 GB test model at {model_dir} ({'built' if built else 'cached'})")
    weights_bytes = sum(p.stat().st_size for p in model_dir.iterdir() if p.suffix == ".safetensors")
    figures: dict[str, float] = {"weights_gib": weights_bytes / 2**30}
    figures["disk_read_mib_s"] = sequential_read_mib_s(model_dir / "model.safetensors")
    figures["floor_disk_s"] = weights_bytes / 2**20 / figures["disk_read_mib_s"]
    emulator = bucket.up(log=log)
    try:
        return _measure_weights(figures, emulator, model_dir, weights_bytes, log)
    finally:
        bucket.down(log=log)


def _measure_weights(figures: dict, emulator, model_dir: Path, weights_bytes: int, log: Log) -> dict[str, float]:
    from gemmaserve.ops.weights import LocalSource, mirror, storage_client
    from gemmaserve.plan import plan
    from gemmaserve.sandbox.profile import DEFAULT_DATA, SANDBOX_BUCKET, bucket_host_data, sandbox_host_data
    from gemmaserve.sources import spec_from_host_data

    os.environ.update(emulator.environ())
    client = storage_client()
    if client.lookup_bucket(SANDBOX_BUCKET) is None:
        client.create_bucket(SANDBOX_BUCKET)
    source = LocalSource(model_dir)
    local_data = {"gemmaserve_model": "test-1g", "gemmaserve_workload": {**DEFAULT_DATA["gemmaserve_workload"]}}
    pulled_data = {**local_data, **bucket_host_data(source.resolve(None), model="test-1g")}
    host_plan = plan(spec_from_host_data({**sandbox_host_data(), **pulled_data})).require_ok()
    report = mirror(host_plan.weights, source, client=client, progress=log)
    figures["mirror_mib_s"] = report.mib_per_s
    figures["bucket_read_mib_s"] = _bucket_read_mib_s(host_plan.weights, log)
    figures["floor_bucket_s"] = weights_bytes / 2**20 / figures["bucket_read_mib_s"]
    hosts = lifecycle.up_new_hosts(2, log=log)
    try:
        first = hosts[0]
        _deploy_with(first, local_data, log)
        _drop_page_cache()
        figures["first_token_weights_local_s"] = _first_token_after(
            first, "systemctl stop vllm@0 && systemctl start --no-block vllm@0", log
        )
        _deploy_with(first, pulled_data, log)
        pull = (
            f"systemctl stop vllm@0 && rm -rf {host_plan.weights.local_dir} && "
            "systemctl restart gemmaserve-weights && systemctl start --no-block vllm@0"
        )
        _drop_page_cache()
        figures["first_token_weights_pulled_s"] = _first_token_after(first, pull, log)
        figures["pulled_over_disk_floor"] = figures["first_token_weights_pulled_s"] / figures["floor_disk_s"]
        figures["local_over_disk_floor"] = figures["first_token_weights_local_s"] / figures["floor_disk_s"]
        log(
            f"first token: weights local {figures['first_token_weights_local_s']:.1f} s, pulled "
            f"{figures['first_token_weights_pulled_s']:.1f} s; floors: disk {figures['floor_disk_s']:.1f} s, "
            f"bucket {figures['floor_bucket_s']:.1f} s"
        )
        figures.update(_second_host_warm_vs_cold(hosts, host_plan.weights.revision, log))
    finally:
        lifecycle.down([h.name for h in hosts], log=log)
    return figures


MODEL_1G_DIR = Path("/var/lib/gemmaserve/models/gemma4-1g-test")


def _bucket_read_mib_s(weights, log: Log) -> float:
    """What the bucket serves: the host puller's own parallel ranged reads, from the outer machine."""
    import tempfile

    from roles._lib.programs import load_program

    puller = load_program("weights", "weights_pull")
    with tempfile.TemporaryDirectory(dir=rootfs.CACHE_DIR) as scratch:
        started = time.monotonic()
        result = puller.pull(puller.gcs_json.Bucket(weights.bucket), weights.object_prefix, Path(scratch) / "w")
        seconds = time.monotonic() - started
    rate = result["bytes"] / 2**20 / seconds
    log(f"bucket read (8 parallel ranged reads, verified): {rate:.0f} MiB/s")
    return rate


def _second_host_warm_vs_cold(hosts: list[state.Host], revision: str, log: Log) -> dict[str, float]:
    """Host A compiles and saves its cache to the bucket; host B deploys from the bucket and starts warm."""
    from gemmaserve.sandbox.profile import DEFAULT_DATA, bucket_host_data

    compiled = {
        "gemmaserve_workload": {**DEFAULT_DATA["gemmaserve_workload"], "enforce_eager": False},
        **bucket_host_data(_tiny_revision()),
    }
    figures = {"deploy_first_host_compiled_s": _deploy_with(hosts[0], compiled, log)}
    machine.in_host(hosts[0], "systemctl", "start", "gemmaserve-cache-save.service", timeout=300)
    figures["deploy_second_host_from_bucket_s"] = _deploy_with(hosts[1], compiled, log)
    warm_from_bucket = (
        "systemctl stop vllm@0 gemmaserve-cache-restore && rm -rf /dev/shm/gemmaserve/* "
        "/var/lib/gemmaserve/compile-cache/* && systemctl start gemmaserve-cache-restore && systemctl start --no-block vllm@0"
    )
    cold = (
        "systemctl stop vllm@0 && rm -rf /dev/shm/gemmaserve/* /var/lib/gemmaserve/compile-cache/* "
        "&& systemctl start --no-block vllm@0"
    )
    figures["second_host_first_token_warm_from_bucket_s"] = _first_token_after(hosts[1], warm_from_bucket, log)
    figures["second_host_first_token_cold_s"] = _first_token_after(hosts[1], cold, log)
    figures["second_host_warm_over_cold"] = (
        figures["second_host_first_token_warm_from_bucket_s"] / figures["second_host_first_token_cold_s"]
    )
    log(
        f"second host, compiled: first token {figures['second_host_first_token_warm_from_bucket_s']:.1f} s warm from "
        f"the bucket's cache, {figures['second_host_first_token_cold_s']:.1f} s cold"
    )
    return figures


def _tiny_revision() -> str:
    """The tiny model mirrored too (the compile figures use it: compiling, not loading, is what they time)."""
    from gemmaserve.ops.weights import LocalSource, mirror, storage_client
    from gemmaserve.plan import plan
    from gemmaserve.sandbox.profile import TINY_MODEL_DIR, bucket_host_data, sandbox_host_data
    from gemmaserve.sources import spec_from_host_data

    source = LocalSource(TINY_MODEL_DIR)
    revision = source.resolve(None)
    host_plan = plan(spec_from_host_data({**sandbox_host_data(), **bucket_host_data(revision)})).require_ok()
    mirror(host_plan.weights, source, client=storage_client(), progress=lambda _: None)
    return revision


# The routing comparison: the shape of the sandbox's routing test (tests/roles/sandbox/test_resilience.py), 32
# conversations of 3 turns, 12 requests at once, the turns in shuffled rounds, each turn adding more than one of
# the CPU backend's 128-token KV blocks, sized for the tiny model's max_model_len of 1,024 tokens (its tokenizer
# makes ~6 tokens of a word here: a system prompt of ~190 tokens, ~150 more per turn, ~680 at the third turn).
ROUTING_WORKLOAD = conversations.Workload(
    conversations=32, turns=3, clients=12, system_prompt_words=30, turn_words=20, max_tokens=8, timeout=120,
    order="rounds",
)  # fmt: skip
# The default policy last, the way the routing test runs them.
ROUTING_POLICIES = ("least-outstanding", "prefix-affinity")


def routing_host_data(policy: str) -> dict:
    """Host data for two replicas under `policy`; no per-key rate limit in the way (the workload is no client
    to limit)."""
    return {
        "gemmaserve_accelerator": {"kind": "cpu", "count": 2},
        "gemmaserve_serving": {"routing": policy, "api_keys": {"requests_per_minute": 100_000}},
    }


def _backends_up(target, replicas: int) -> bool:
    import json

    from roles._lib.programs import HAPROXY_ADMIN

    result = target.run(f"python3 {HAPROXY_ADMIN} status vllm")
    try:
        rows = json.loads(result.stdout)
    except ValueError:
        return False
    return len(rows) == replicas and set(rows.values()) == {"UP"}


def _run_names(workload: conversations.Workload, run: int) -> list[str]:
    """New conversations for run `run`, named alike in every run: a name is part of each prompt, so names of one
    length give every run the same prompt lengths, and so the same ideal."""
    return conversations.conversation_names(workload.conversations, f"routing-run{run}")


def _warm_up(target, host_plan, workload: conversations.Workload, log: Log) -> None:
    """A few requests of the workload's sizes straight to each replica before the first measured run: a replica's
    first batches of new shapes run slower, and a slower replica draws fewer requests under least-outstanding
    (measured: a 91 / 9 share on a first run without this). Their prefixes are no measured conversation's."""
    import json

    started = time.monotonic()
    names = conversations.conversation_names(4, "warm-up")
    for replica in host_plan.replicas:
        for name in names:
            body = {
                "model": host_plan.model.hf_id,
                "max_tokens": workload.max_tokens,
                "messages": [
                    {"role": "system", "content": conversations.system_prompt(name, workload.system_prompt_words)},
                    {"role": "user", "content": conversations.user_message(name, 1, workload.turn_words)},
                ],
            }
            url = f"http://127.0.0.1:{replica.port}/v1/chat/completions"
            result = target.run(
                f"curl -fsS -m 120 -o /dev/null -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))} {url}"
            )
            if result.rc != 0:
                raise RuntimeError(f"warm-up of replica {replica.index} failed: {result.stderr.strip()[:300]}")
    log(
        f"warmed up {len(host_plan.replicas)} replicas with {len(names)} requests each in {time.monotonic() - started:.1f} s"
    )


def measure_routing(
    workload: conversations.Workload = ROUTING_WORKLOAD, log: Log = print, vllm_router: bool = True
) -> list[conversations.PolicyRun]:
    """Both routing policies on one fresh host of two replicas, one after the other: deploy the policy (after
    the first deploy only HAProxy reloads), wait until both replicas are UP behind it, then run the workload
    with conversations no run has sent before. With `vllm_router`, then the same workload through vllm-router
    (gemmaserve.sandbox.router_engines) under each of its policies, in front of the same replicas."""
    from gemmaserve.ops.endpoint import Credentials, Endpoint
    from gemmaserve.ops.fleet import FleetHost
    from gemmaserve.sandbox import credentials, router_engines
    from gemmaserve.sandbox.demo import ensure_engine_and_model
    from gemmaserve.sandbox.profile import sandbox_host_data

    ensure_engine_and_model()
    if vllm_router:
        # Before the host boots: the venvs directory is bound into it.
        router_engines.ensure_venv(log)
    [host] = lifecycle.up_new_hosts(1, log=log)
    runs = []
    try:
        for policy in ROUTING_POLICIES:
            data = routing_host_data(policy)
            seconds = _deploy_with(host, data, log)
            fleet_host = FleetHost(host.name, {**host.ssh_data(), **sandbox_host_data(host.host_data), **data})
            host_plan, target = fleet_host.plan, fleet_host.connect()
            if host_plan.routing.policy != policy or len(host_plan.replicas) != 2:
                raise RuntimeError(
                    f"{host.name}: planned {host_plan.routing.policy}, {len(host_plan.replicas)} replicas"
                )
            log(f"{policy}: deployed in {seconds:.1f} s; waiting for both replicas behind HAProxy")
            deadline = time.monotonic() + 120
            while not _backends_up(target, len(host_plan.replicas)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{host.name}: both replicas not UP in HAProxy 120 s after deploying {policy}")
                time.sleep(1)
            if not runs:
                _warm_up(target, host_plan, workload, log)
            log(f"{policy}: {workload.describe()}")
            run = conversations.measure(
                credentials.endpoint(host),
                host_plan.model.hf_id,
                workload,
                host_plan.replicas[0].capacity.prefix_cache_block,
                partial(conversations.read_counters, target, host_plan, host.name),
                host=host.name,
                policy=policy,
                names=_run_names(workload, len(runs)),
            )
            reuse = "-" if run.reuse_of_ideal is None else f"{run.reuse_of_ideal:.0%}"
            log(f"{policy}: prefix reuse {reuse} of ideal, {run.completed} turns answered, {run.failed} failed")
            runs.append(run)
        for policy in router_engines.POLICIES if vllm_router else ():
            name = f"vllm-router {router_engines.VERSION} {policy}"
            url = router_engines.start(target, host_plan, host.address, policy, log)
            try:
                log(f"{name}: {workload.describe()}")
                run = conversations.measure(
                    Endpoint(url, Credentials()),
                    host_plan.model.hf_id,
                    workload,
                    host_plan.replicas[0].capacity.prefix_cache_block,
                    partial(conversations.read_counters, target, host_plan, host.name),
                    host=host.name,
                    policy=f"vllm-router-{policy}",
                    names=_run_names(workload, len(runs)),
                    label=name,
                )
            finally:
                router_engines.stop(target)
            reuse = "-" if run.reuse_of_ideal is None else f"{run.reuse_of_ideal:.0%}"
            log(f"{name}: prefix reuse {reuse} of ideal, {run.completed} turns answered, {run.failed} failed")
            runs.append(run)
    finally:
        lifecycle.down([host.name], log=log)
    return runs
