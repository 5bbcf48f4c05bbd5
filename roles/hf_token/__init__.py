"""The Hugging Face token: from Secret Manager (fetched at unit start into tmpfs) or from a file on the
host; either way it reaches vLLM only as a systemd credential (HF_TOKEN_PATH), never as text in a unit,
an env file, the journal or a process environment."""

from __future__ import annotations

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.files import File

from gemmaserve.plan import TOKEN_RUNTIME_PATH, Plan
from roles._lib.facts import HostState
from roles._lib.managed import managed_secret, managed_unit, require_base
from roles._lib.programs import installed_path
from roles._lib.render import render
from roles._lib.settings import LocalFile, RoleSettings

TEMPLATES = Path(__file__).parent / "templates"
FETCH_UNIT = "gemmaserve-hf-token.service"


class Settings(RoleSettings):
    prefix = "hf_token_"
    # A token file on the control machine to install at the spec's secret.file path (mode 0400).
    src: LocalFile | None = None
    # This role was `secrets`, its one key secrets_hf_token_src.
    former_keys = {"secrets_hf_token_src": "write hf_token_src (the secrets role is now hf_token)"}


class MissingSecret(Exception):
    pass


@deploy("Provide the Hugging Face token", data_defaults=Settings.defaults())
def hf_token(plan: Plan) -> None:
    source = plan.spec.secret
    if source is None:
        return
    if source.file:
        _file_source(source.file, Settings.from_host(host))
    else:
        _secret_manager_source(source.secret_manager)


def _file_source(path: str, settings: Settings) -> None:
    if settings.src:
        managed_secret(
            name=f"Install the Hugging Face token file {path}",
            dest=path,
            content=Path(settings.src),
            current=HostState(host, paths=[path]).path(path),
        )
        return
    if not host.get_fact(File, path=path):
        raise MissingSecret(
            f"{host.name}: secret.file = {path!r}: no such file on the host; place the token there "
            "(mode 0400) or set hf_token_src to a local file to upload"
        )


def _secret_manager_source(secret: str) -> None:
    # The Secret Manager fetcher the unit runs is the base role's.
    require_base("hf_token")
    script, unit_path = installed_path("secret_fetch.py"), f"/etc/systemd/system/{FETCH_UNIT}"
    now = HostState(host, paths=[unit_path], units=[FETCH_UNIT])
    # Enabled: it runs at boot, before the replicas (and the weights unit that needs the token).
    content = render(TEMPLATES / f"{FETCH_UNIT}.j2", script=script, secret=secret, out=TOKEN_RUNTIME_PATH)
    managed_unit(FETCH_UNIT, content, now, running=None)
