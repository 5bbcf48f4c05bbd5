"""Find a replica's vLLM API server on a host, whichever engine runs it."""

from __future__ import annotations


def server_pid(host, index: int) -> str:
    """PID of replica `index`'s `vllm serve` process (testinfra `host`): the unit's main process with a
    venv; under podman a process of the container, which stays in the unit's cgroup (--cgroups=disabled),
    so `ps -o unit` finds it there too. Empty when none runs."""
    unit = f"vllm@{index}.service"
    script = (
        f"for p in $(ps -e -o pid= -o unit= | awk '$2 == \"{unit}\" {{print $1}}'); do "
        "tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null | grep -Eq '(^|[ /])vllm serve ' && echo $p; done | head -1"
    )
    return host.run(script).stdout.strip()
