"""Weights on local disk before any replica starts: pulled from the stack's bucket (one verified copy per
host, shared by its replicas) or, without a mirror, downloaded from Hugging Face by the engine's own `hf`
client. Either way it is gemmaserve-weights.service, ordered before the replicas, so the health window
of a replica never has to cover a download; a deploy checks the mirror before it restarts anything. The
spec's LoRA adapters come from the bucket with the weights (streamed weights too): the same puller, before
the model; without the bucket, the pinned hub adapters (and, beside a directory or gs:// model, whose replicas run
offline, the pinned MTP assistant) are downloaded by the same `hf` client, before the model."""

from __future__ import annotations

import shlex
from pathlib import Path

from pyinfra import host
from pyinfra.api import FactBase, deploy, operation

from gemmaserve.plan import HF_HOME, STATE_DIR, WEIGHTS_DIR, Plan
from roles._lib.facts import HostState
from roles._lib.managed import install_programs, managed_directory, managed_unit
from roles._lib.programs import LIB_DIR, STORAGE_EMULATOR_KEY, installed_path
from roles._lib.render import render
from roles._lib.settings import RoleSettings

TEMPLATES = Path(__file__).parent / "templates"
UNIT = "gemmaserve-weights.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
PULL = installed_path("weights_pull.py")


class Settings(RoleSettings):
    prefix = "weights_"
    # Parallel ranged downloads per host (each a 64 MiB piece).
    parallel: int = 8


class WeightsMarkers(FactBase[list[str]]):
    """The marker each finished fetch leaves (the manifest digest, or "hub"), in the order asked, "" for one that
    is not local (an adapter, then the model):

    .. code:: python

        ["", "6f1c...e2"]
    """

    def command(self, paths: list[str]) -> str:
        return "; ".join(f"printf 'marker %s\\n' \"$(cat {shlex.quote(p)} 2>/dev/null)\"" for p in paths)

    def process(self, output: list[str]) -> list[str]:
        return [line.removeprefix("marker").strip() for line in output if line.startswith("marker")]


class MirrorCheck(FactBase[str]):
    """The installed puller's `check` of the mirror from this host: "ok", the error it printed, or "" when
    the puller is not installed yet (a first deploy checks in the fetch operation instead):

    .. code:: python

        "gemmaserve-weights: failed: gs://acme: no such bucket (weights.bucket)"
    """

    def command(self, bucket: str, prefixes: list[str], emulator: str | None) -> str:
        check = check_command(bucket, prefixes, emulator)
        return f"if test -f {PULL}; then {check} >/dev/null 2>&1 && echo ok || {check} 2>&1 | tail -1; fi"

    def process(self, output: list[str]) -> str:
        return "\n".join(output).strip()


def pulls(plan: Plan) -> list[tuple[str, str]]:
    """(object prefix, local directory) of each revision the puller fetches from the bucket: the adapters and the MTP
    assistant, then the model (pull mode), so the model's marker, the one replicas check, is the last written."""
    weights = plan.weights
    found = [(a.object_prefix, a.local_dir) for a in weights.adapters] if weights.from_bucket else []
    if weights.assistant:
        found.append((weights.assistant.object_prefix, weights.assistant.local_dir))
    if weights.mode == "pull":
        found.append((weights.object_prefix, weights.local_dir))
    return found


def marker_paths(plan: Plan) -> list[str]:
    """The marker of every fetch, the one replicas wait for last."""
    if found := pulls(plan):
        return [f"{local}/.gemmaserve-complete" for _, local in found]
    return [hub_marker(repo, revision) for repo, revision in hub_downloads(plan)]


def hub_downloads(plan: Plan) -> list[tuple[str, str | None]]:
    """(repo id, revision) of each `hf download` on the wheel engine: the pinned adapters, the MTP assistant of a
    directory or gs:// model, then (hub mode) the model, whose marker replicas check; none from the bucket or in a
    container."""
    weights = plan.weights
    if weights.from_bucket or plan.engine.kind != "wheel":
        return []
    found: list[tuple[str, str | None]] = [*weights.hub_adapters]
    if weights.hub_assistant:
        found.append(weights.hub_assistant)
    if weights.mode == "hub":
        found.append((weights.model_id, weights.revision))
    return found


def hub_marker(repo: str, revision: str | None) -> str:
    return f"{WEIGHTS_DIR}/.hub-{repo.replace('/', '--')}-{revision or 'main'}.complete"


def marker_path(plan: Plan) -> str | None:
    """What a replica checks before it starts: the last fetch's marker, None when nothing is fetched."""
    return next(reversed(marker_paths(plan)), None)


def check_command(bucket: str, prefixes: list[str], emulator: str | None) -> str:
    env = f"STORAGE_EMULATOR_HOST={shlex.quote(emulator)} " if emulator else ""
    each = " ".join(f"--prefix {shlex.quote(p)}" for p in prefixes)
    return f"{env}/usr/bin/python3 {PULL} check --bucket {shlex.quote(bucket)} {each}"


def fetch_command(plan: Plan, settings: Settings) -> str:
    """What gemmaserve-weights.service runs: the puller (mirror) or the engine's `hf download` (hub)."""
    weights = plan.weights
    if found := pulls(plan):
        each = " ".join(f"--prefix {prefix} --dest {local}" for prefix, local in found)
        return f"/usr/bin/python3 {PULL} pull --bucket {weights.bucket} {each} --parallel {settings.parallel}"
    steps = []
    for repo, revision in hub_downloads(plan):
        pin = f" --revision {revision}" if revision else ""
        # The model's original/ folder holds the same weights in another format; vLLM reads neither it nor an
        # adapter's extras, but an adapter repository is small and taken whole.
        exclude = ' --exclude "original/*"' if repo == weights.model_id else ""
        steps.append(f"{plan.engine.venv}/bin/hf download {repo}{pin}{exclude} && touch {hub_marker(repo, revision)}")
    return f"/bin/sh -c '{' && '.join(steps)}'"


def unit_context(plan: Plan, settings: Settings, emulator: str | None) -> dict:
    weights = plan.weights
    from_hub = bool(hub_downloads(plan)) and not pulls(plan)
    environment = {"HF_HOME": HF_HOME, "HF_HUB_DISABLE_TELEMETRY": "1"} if from_hub else {}
    if emulator and pulls(plan):
        environment["STORAGE_EMULATOR_HOST"] = emulator
    fetch_unit = "gemmaserve-hf-token.service" if plan.spec.secret and plan.spec.secret.secret_manager else None
    return {
        "model": weights.model_id,
        "after": fetch_unit if from_hub else None,
        "environment": environment,
        "credential": plan.token_source_path if from_hub else None,
        "command": fetch_command(plan, settings),
        "user": "gemmaserve",
        "writable": STATE_DIR,
    }


def unit_name(plan: Plan) -> str | None:
    """The unit replicas wait for, or None when there is nothing to fetch (test models, streaming, containers)."""
    return UNIT if marker_path(plan) else None


@deploy("Fetch the weights before replicas start", data_defaults=Settings.defaults())
def weights(plan: Plan) -> None:
    markers = marker_paths(plan)
    if not markers:
        return
    settings = Settings.from_host(host)
    emulator = host.data.get(STORAGE_EMULATOR_KEY)
    from_bucket = pulls(plan)
    paths = [WEIGHTS_DIR, UNIT_PATH]
    if from_bucket:
        paths += [LIB_DIR, PULL]
    now = HostState(host, paths=paths, units=[UNIT])
    managed_directory(
        name=f"Create {WEIGHTS_DIR}",
        path=WEIGHTS_DIR,
        current=now.path(WEIGHTS_DIR),
        user="gemmaserve",
        group="gemmaserve",
        mode="0755",
    )
    if from_bucket:
        # Beside the gcs_json.py and hostlib.py the base role installed.
        install_programs("weights", now)
    # Run by fetch_before_replicas below (and at boot, before the replicas), never restarted here.
    managed_unit(UNIT, render(TEMPLATES / f"{UNIT}.j2", **unit_context(plan, settings, emulator)), now, running=None)
    checked = ""
    if from_bucket:
        # Every deploy checks the mirror as this host sees it (a fact: no change when all is well), so a
        # wrong bucket or revision fails here even on a host whose weights are already local.
        checked = host.get_fact(
            MirrorCheck, bucket=plan.weights.bucket, prefixes=[prefix for prefix, _ in from_bucket], emulator=emulator
        )
    fetched = [f"{plan.weights.model_id} weights"] if plan.weights.mode in ("pull", "hub") else []
    adapters = len(plan.weights.adapters) if from_bucket else len(plan.weights.hub_adapters)
    if adapters:
        fetched.append(f"{adapters} LoRA adapter(s)")
    if assistant := plan.weights.assistant or plan.weights.hub_assistant:
        fetched.append(f"the MTP assistant {assistant.model_id if from_bucket else assistant[0]}")
    what = " and ".join(fetched)
    fetch_before_replicas(
        name=f"Fetch {what} to local disk before any replica restarts",
        plan=plan,
        emulator=emulator,
        done=all_local(host.get_fact(WeightsMarkers, paths=markers), markers),
        checked=checked,
    )


def all_local(found: list[str], markers: list[str]) -> bool:
    return len(found) == len(markers) and all(found)


@operation(is_idempotent=False)
def fetch_before_replicas(plan: Plan, emulator: str | None, done: bool, checked: str = ""):
    """Check the mirror has the revision (a clear error, before anything restarts), then run the fetch
    unit and wait for it; a revision already local is left alone (a revision's files never change)."""
    weights = plan.weights
    if checked and checked != "ok":
        yield f"echo {shlex.quote(checked)} >&2; exit 1"
        return
    if done:
        host.noop(f"every fetch is local ({weights.local_dir or HF_HOME})")
        return
    if found := pulls(plan):
        yield check_command(weights.bucket, [prefix for prefix, _ in found], emulator)
    # A oneshot: `start` returns when the weights are local (or fails with the program's error).
    yield (
        "systemctl reset-failed gemmaserve-weights.service 2>/dev/null; systemctl restart gemmaserve-weights.service "
        "|| { journalctl -u gemmaserve-weights.service -n 20 --no-pager -o cat >&2; exit 1; }"
    )
