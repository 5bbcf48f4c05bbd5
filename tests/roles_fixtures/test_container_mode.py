"""Container mode cannot run on the sandbox (no Docker engine): render its unit and commands from real
plans and check what a container host would get."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmaserve.plan import plan
from gemmaserve.spec import parse_spec
from gemmaserve.stack import load_stack_spec
from roles.batch import render as render_template
from roles.replicas import TEMPLATES, argcheck_command, unit_context

ROOT = Path(__file__).resolve().parents[2]


def render(serving) -> str:
    return render_template(TEMPLATES / "vllm@.service.j2", **unit_context(serving, {}))


def exec_start(unit: str) -> str:
    return next(line for line in unit.splitlines() if line.startswith("ExecStart="))


@pytest.fixture(scope="module")
def tpu():
    return plan(load_stack_spec("tpu-v6e4", ROOT)).require_ok()


def gpu(kind: str, count: int):
    data = {
        "model": "31b",
        "accelerator": {"kind": kind, "count": count},
        "engine": {"kind": "container", "image": "vllm/vllm-openai:v0.33.0"},
        "secret": {"file": "/etc/gemmaserve/hf-token"},
    }
    return plan(parse_spec(data)).require_ok()


def test_tpu_unit_runs_the_pinned_image(tpu):
    line = exec_start(render(tpu))
    assert line.startswith("ExecStart=/usr/bin/docker run ")
    assert "vllm/vllm-tpu:v0.32.0 $VLLM_ARGS" in line


@pytest.mark.parametrize(
    "flag",
    [
        "--network=host",
        "--ipc=host",
        "--privileged",
        "-v /dev/shm:/dev/shm",
        "--env-file /etc/gemmaserve/replica-%i.env",
    ],
)
def test_tpu_container_flags(tpu, flag):
    assert flag in exec_start(render(tpu))  # seeds 01/04: privileged, host network, the host's /dev/shm


def test_no_install_at_container_start(tpu):
    unit = render(tpu)
    assert "pip install" not in unit and "git+" not in unit  # seed 04's mistake


def test_container_unit_runs_as_root_for_the_docker_socket(tpu):
    assert "User=root" in render(tpu) and "User=gemmaserve" not in render(tpu)


def test_stale_container_removed_before_start(tpu):
    assert "ExecStartPre=-/usr/bin/docker rm -f vllm-%i" in render(tpu)


def test_nvidia_container_gets_only_its_gpus():
    line = exec_start(render(gpu("rtx-pro-6000", 8)))
    assert "--gpus device=${CUDA_VISIBLE_DEVICES}" in line and "--privileged" not in line


def test_amd_container_gets_kfd_and_dri():
    line = exec_start(render(gpu("mi300x", 8)))
    assert "--device=/dev/kfd" in line and "--device=/dev/dri" in line and "--group-add=video" in line


def test_credential_mounted_read_only():
    assert "-v ${CREDENTIALS_DIRECTORY}:/run/credentials/vllm@%i.service:ro" in exec_start(render(gpu("h100-80gb", 8)))


def test_flags_checked_inside_the_same_image(tpu):
    command = argcheck_command(tpu)
    assert command.startswith("/usr/bin/docker run --rm --network=none")
    assert "--entrypoint python3 vllm/vllm-tpu:v0.32.0 /opt/gemmaserve/lib/vllm_argcheck.py" in command


def test_wheel_unit_runs_the_venv_as_the_service_user():
    serving = plan(parse_spec({"model": "e2b", "accelerator": {"kind": "l4"}})).require_ok()
    unit = render(serving)
    assert exec_start(unit) == "ExecStart=/opt/gemmaserve/venvs/vllm-0.33.0/bin/vllm serve $VLLM_ARGS"
    assert "User=gemmaserve" in unit and "docker" not in unit
