"""A replica with torch.compile on (no --enforce-eager): the compile cache on /dev/shm is what a restart
reuses, and after /dev/shm is wiped (a reboot, a preemption) the copy saved to disk is restored so nothing
is compiled again. "Compiled again" is read from the files inductor writes for each kernel it builds, not
from timings. The replica is bucket host A's (tests/sandbox_fixtures.py: deployed once per session for
these tests and the bucket's): its first start compiled, since the bucket held no cache yet."""

from __future__ import annotations

import json

import pytest

from tests.sandbox_fixtures import BucketHosts, sandbox_endpoint, wait_until

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def compiled(bucket_hosts: BucketHosts):
    return bucket_hosts.hosts[0], bucket_hosts.plan, bucket_hosts.remotes[0]


def kernels(remote, key: str) -> dict[str, float]:
    """The C++ kernels inductor built for this cache key, with their modification times: a kernel built
    again is written again (same hashed name, new time); a restored one keeps its time (copy2)."""
    found = remote.run(
        f"find /dev/shm/gemmaserve/{key} -type f \\( -name '*.so' -o -name '*.cpp' \\) -printf '%P %T@\\n'"
    )
    assert found.rc == 0, found.stderr
    return {path: float(mtime) for path, mtime in (line.rsplit(" ", 1) for line in found.stdout.splitlines())}


def restart_and_wait(remote, command: str) -> None:
    """Run `command`, wait for the new vLLM's /health, then until HAProxy routes to it again."""
    assert remote.run(command).rc == 0
    wait_until(
        lambda: remote.run("curl -fsS -o /dev/null http://127.0.0.1:8000/health").rc == 0,
        600,
        "the compiled replica to report healthy",
    )
    status = "python3 /opt/gemmaserve/lib/haproxy_admin.py status vllm"
    wait_until(
        lambda: json.loads(remote.run(status).stdout or "{}") == {"replica0": "UP"},
        600,
        "HAProxy to route to the compiled replica again",
    )


def chat(host, model: str) -> str:
    payload = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    status, body = sandbox_endpoint(host).request("/v1/chat/completions", payload)
    assert status == 200, body[:300]
    return json.loads(body)["choices"][0]["finish_reason"]


def test_compiled_replica_serves(compiled):
    host, plan, remote = compiled
    replica = plan.replicas[0]
    assert "--enforce-eager" not in replica.argv
    env = remote.file("/etc/gemmaserve/replica-0.env").content_string
    assert "VLLM_USE_AOT_COMPILE=0" in env and "--enforce-eager" not in env
    # The role installed what inductor needs to build kernels: a C++ compiler and Python's headers.
    assert remote.package("g++").is_installed and remote.package("python3-dev").is_installed
    assert chat(host, plan.model.hf_id) in ("length", "stop")


def test_first_start_compiled_kernels_into_the_shm_cache(compiled):
    _, plan, remote = compiled
    assert kernels(remote, plan.replicas[0].cache_key), "torch.compile left no kernels in the /dev/shm cache"


def test_warm_restart_compiles_nothing(compiled):
    _, plan, remote = compiled
    key = plan.replicas[0].cache_key
    before = kernels(remote, key)
    restart_and_wait(remote, "systemctl restart vllm@0")
    assert kernels(remote, key) == before


def test_cache_restored_from_disk_after_shm_is_wiped(compiled):
    """As after a reboot or a preemption: /dev/shm is empty, the disk copy comes back before vLLM starts."""
    host, plan, remote = compiled
    key = plan.replicas[0].cache_key
    before = kernels(remote, key)
    # Stopping the restore unit saves to disk (its ExecStop), as at shutdown.
    assert remote.run("systemctl stop vllm@0 && systemctl stop gemmaserve-cache-restore").rc == 0
    assert remote.run('rm -rf /dev/shm/gemmaserve/* && test -z "$(ls /dev/shm/gemmaserve)"').rc == 0
    restart_and_wait(remote, "systemctl start gemmaserve-cache-restore && systemctl start vllm@0")
    assert kernels(remote, key) == before
    assert chat(host, plan.model.hf_id) in ("length", "stop")


def test_cold_start_compiles_again(compiled):
    """The check above can fail: with the caches gone everywhere, vLLM does build kernels anew."""
    _, plan, remote = compiled
    key = plan.replicas[0].cache_key
    assert (
        remote.run("systemctl stop vllm@0 && rm -rf /dev/shm/gemmaserve/* /var/lib/gemmaserve/compile-cache/*").rc == 0
    )
    started = float(remote.run("date +%s.%N").stdout)
    restart_and_wait(remote, "systemctl start vllm@0")
    rebuilt = kernels(remote, key)
    assert rebuilt and min(rebuilt.values()) >= started
