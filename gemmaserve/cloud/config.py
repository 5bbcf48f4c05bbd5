"""Every stack config read in one place: the spec the roles use, plus the validated `gemmaserve:cloud` settings."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gemmaserve.catalog import CATALOG, GcpMachineType, TpuType
from gemmaserve.plan import Plan, plan
from gemmaserve.sources import (
    NAMESPACE,
    SPEC_KEYS,
    read_stack_config,
    spec_from_config,
    stack_prefix,
    stack_scoped_secrets,
)
from gemmaserve.spec import (
    Spec,
    SpecError,
    Strict,
    internet_share,
    opens_the_internet,
    parse_duration,
    validate_model,
)

# Google's documented ranges: IAP TCP forwarding (SSH without public IPs) and the load balancer
# health-check probers (cloud.google.com/load-balancing/docs/health-check-concepts).
IAP_RANGE = "35.235.240.0/20"
HEALTH_CHECK_RANGES = ("130.211.0.0/22", "35.191.0.0/16")
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
# Flex-start capacity is granted for at most 7 days (cloud.google.com/tpu/docs/flex-start and compute/docs/instances/flex-start-vms).
FLEX_START_MAX = timedelta(days=7)
# ... and for at least 10 minutes (cloud.google.com/compute/docs/instances/about-flex-start-vms, "Flex-start
# VM limited run duration"): a shorter max_run_duration is refused by the API after the queue wait.
FLEX_START_MIN = timedelta(minutes=10)
# Flex-start TPUs are sold in a few zones only, per TPU generation
# (https://cloud.google.com/tpu/docs/request-using-flex-start, "Limitations").
TPU_FLEX_START_ZONES = {"tpu-v6e": ("asia-northeast1-b", "us-east5-a"), "tpu-v5e": ("us-central1-a",)}
# Flex-start VMs: every accelerator-optimized series except A4X and G4
# (https://cloud.google.com/compute/docs/instances/about-flex-start-vms).
NO_FLEX_START_SERIES = ("a4x", "g4")
# G4 VMs attach Hyperdisk (and Titanium SSD) only, no Persistent Disk
# (https://cloud.google.com/compute/docs/accelerator-optimized-machines#g4-series).
HYPERDISK_ONLY_SERIES = ("g4",)
# A flex-start VM request waits up to two hours for capacity before it fails
# (https://cloud.google.com/blog/products/compute/introducing-flex-start-vms-for-the-compute-engine-instance-api):
# the instance's create timeout covers that and the boot, instead of the provider's default 20 minutes.
FLEX_START_VM_CREATE_TIMEOUT = "130m"
# The data disk a TPU VM's weights live on, by generation: a TPU VM has a 100 GiB boot disk that cannot
# grow, v6e and TPU7x attach Hyperdisk (Balanced or ML) and no Persistent Disk, v5e Balanced Persistent
# Disk (https://cloud.google.com/tpu/docs/attach-durable-block-storage,
# https://cloud.google.com/tpu/docs/storage-options).
TPU_DATA_DISK_TYPES = {
    "tpu-v6e": ("hyperdisk-balanced",),
    "tpu-v7": ("hyperdisk-balanced",),
    "tpu-v5e": ("pd-balanced",),
}
# A slice larger than one TPU VM (the catalog's max_devices_per_host: 8 on v6e and v5e, 4 on TPU7x) spans
# several VMs, each a host with its own address (the node's networkEndpoints); a stack serves one host per
# slice, so the spec refuses such a count (AcceleratorSpec, naming the VMs it would span).
TPU_KINDS = tuple(a.name for a in CATALOG.accelerators if a.vendor == "google")
# Not offered as the Cloud TPU API's queued resources this program uses: Google's TPU7x page said "To use
# TPU7x, you must use Google Kubernetes Engine (GKE)" (cloud.google.com/tpu/docs/tpu7x; now it names GKE and
# Compute Engine's TPU machine types, cloud.google.com/compute/docs/tpus/tpu-machines; the queued
# resources page says the same, cloud.google.com/tpu/docs/queued-resources).
GKE_ONLY_TPUS = {"tpu-v7": "https://cloud.google.com/tpu/docs/tpu7x"}
# What the disk holds besides the checkpoint: the serving engine (a vLLM TPU container image or wheel venv;
# an image is pulled compressed and unpacked, so twice its size while it lands) and the compile caches,
# then a margin for a second revision during a rolling change. Our estimates, not a vendor figure.
TPU_DISK_ENGINE_GIB = 40
TPU_DISK_CACHES_GIB = 20
TPU_DISK_MARGIN = 1.25
_ZONE = re.compile(r"^([a-z]+-[a-z]+\d+)-[a-z]$")
_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
_RESOURCE_ID = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_REGION = re.compile(r"^[a-z]+-[a-z]+\d+$")
_PROJECT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")

Provisioning = Literal["standard", "guaranteed", "spot", "reserved", "flex-start"]


class WeightsDisk(Strict):
    """Where weights and compile caches live: local NVMe SSD (fast, lost on stop) or a persistent disk."""

    type: Literal["pd-balanced", "pd-ssd", "hyperdisk-balanced", "local-ssd", "none"] = "pd-balanced"
    size_gb: int = Field(
        500,
        ge=50,
        le=65536,
        description="Disk size; ignored for local-ssd. TPU: unset sizes the data disk from the plan.",
    )
    local_ssd_count: int = Field(
        1, ge=1, le=32, description="375 GB NVMe partitions for local-ssd; A2 Ultra/A3/A4 use their bundle."
    )


class WeightsBucketConfig(Strict):
    """The bucket `gemmaserve:weights.bucket` names, created by this stack (unless `create: false`)."""

    create: bool = Field(True, description="False when the bucket is shared with another stack that creates it.")
    location: str | None = Field(None, description="Bucket location; default: the hosts' region.")
    writers: tuple[str, ...] = Field(
        (), description="Who mirrors weights into it: user:EMAIL, group:EMAIL or serviceAccount:EMAIL."
    )
    force_destroy: bool = Field(False, description="Let `pulumi destroy` delete a bucket that still holds weights.")

    @field_validator("writers")
    @classmethod
    def _members(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [m for m in value if not re.match(r"^(user|group|serviceAccount):[^@\s]+@[^@\s]+$", m)]
        if bad:
            raise ValueError(f"{bad}: allowed: user:EMAIL, group:EMAIL or serviceAccount:EMAIL")
        return value


class Network(Strict):
    cidr: str = Field("10.42.0.0/16", description="VPC range; each region gets one /20, the LB proxy subnet the last.")

    @field_validator("cidr")
    @classmethod
    def _private_range(cls, value: str) -> str:
        try:
            net = ipaddress.IPv4Network(value)
        except ValueError:
            raise ValueError("not an IPv4 CIDR; allowed: a private range such as 10.42.0.0/16") from None
        if not net.is_private or net.prefixlen > 18:
            raise ValueError("allowed: a private (RFC 1918) range of size /18 or larger")
        return value


class ServingImage(Strict):
    """The Artifact Registry repository, and optionally a pinned serving image built into it."""

    repository: str | None = Field(
        None, description="Artifact Registry repository id; default: the stack's prefix (one per stack)."
    )
    build: bool = Field(False, description="Build the serving image with pulumi-docker (needs a Docker daemon).")

    @field_validator("repository")
    @classmethod
    def _repository_id(cls, value: str | None) -> str | None:
        if value is not None and not _RESOURCE_ID.match(value):
            raise ValueError("allowed: lowercase letters, digits and hyphens, starting with a letter (max 63)")
        return value


class Cloud(Strict):
    """`gemmaserve:cloud`: where and how capacity is bought. Defaults are the safe choice."""

    zones: tuple[str, ...] = Field(
        min_length=1, description="TPU: tried in order while a zone has no capacity. GPU: hosts spread round-robin."
    )
    provisioning: Provisioning = "standard"
    fallback_provisioning: tuple[Provisioning, ...] = Field(
        (),
        description="TPU: provisioning models tried after every zone failed with `provisioning`, in order"
        " (e.g. [spot, flex-start] after reserved).",
    )
    reservation: str | None = Field(
        None,
        description="Reservation name (one per zone), or projects/P/locations/ZONE/reservations/NAME (that zone"
        " only); required when the chain has 'reserved'.",
    )
    max_run_duration: str | None = Field(None, description="Hard stop, e.g. 7d; required by flex-start (<= 7d).")
    termination_action: Literal["DELETE", "STOP"] = Field(
        "DELETE", description="What happens at max_run_duration or preemption."
    )
    valid_until: str | None = Field(
        None, description="TPU queue: a request not provisioned within this is FAILED; the next candidate is tried."
    )
    create_wait: str = Field(
        "10m", description="TPU: how long `pulumi up` waits for the queue before it returns with the state."
    )
    recycle_before: str = Field(
        "30m", description="TPU flex-start: re-queue this long before the run duration ends (0s: never)."
    )
    valid_after: datetime | None = Field(
        None, description="TPU queue: do not provision before this time (ISO 8601 with zone)."
    )
    hosts: int = Field(1, ge=1, le=16, description="Serving hosts; more than one puts a load balancer in front.")
    boot_image: str = Field(
        "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64",
        description="GPU VM boot image; the nvidia role installs the driver.",
    )
    boot_disk_type: Literal["pd-balanced", "pd-ssd", "hyperdisk-balanced"] = "pd-balanced"
    boot_disk_gb: int = Field(100, ge=20, le=65536)
    weights_disk: WeightsDisk = WeightsDisk()
    network: Network = Network()
    serving_port_cidrs: tuple[str, ...] = Field((), description="Who may reach the router port directly.")
    allow_public_serving: bool = Field(False, description="Must be true before 0.0.0.0/0 is accepted above.")
    allow_external_ip: bool = Field(False, description="Hosts reach Google APIs and the internet via PGA + Cloud NAT.")
    ssh_user: str = "gemmaserve"
    labels: dict[str, str] = Field(default_factory=dict)
    secret_replication: Literal["automatic"] | tuple[str, ...] = Field(
        "automatic", description="'automatic' or a list of regions for user-managed replication."
    )
    image: ServingImage = ServingImage()
    protect: bool = Field(True, description="Protect TPU queued resources from `pulumi destroy`.")
    weights_bucket: WeightsBucketConfig = WeightsBucketConfig()

    @field_validator("zones")
    @classmethod
    def _zones(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [z for z in value if not _ZONE.match(z)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))} not a zone; allowed: zone names such as us-east5-b")
        if len(set(value)) != len(value):
            raise ValueError("a zone is listed twice")
        return value

    @field_validator("max_run_duration", "valid_until", "create_wait", "recycle_before")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value

    @field_validator("valid_after")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("needs a time zone; allowed: ISO 8601 such as 2026-01-31T08:00:00Z")
        return value

    @field_validator("serving_port_cidrs")
    @classmethod
    def _cidrs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr)
            except ValueError:
                raise ValueError(f"{cidr!r} is not a CIDR; allowed: ranges such as 10.0.0.0/8") from None
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(str(label)):
                raise ValueError(
                    f"{key}={label!r}: allowed: lowercase keys/values of letters, digits, '_' and '-' (max 63)"
                )
        return value

    @field_validator("secret_replication")
    @classmethod
    def _regions(cls, value: Any) -> Any:
        if value != "automatic" and (not value or not all(_REGION.match(r) for r in value)):
            raise ValueError("allowed: 'automatic' or a non-empty list of regions such as [us-east5]")
        return value

    @model_validator(mode="after")
    def _fits_together(self) -> Cloud:
        problems: list[tuple[str, Any, str]] = []
        duration = parse_duration(self.max_run_duration) if self.max_run_duration else None
        chain = self.provisioning_chain
        if len(set(chain)) != len(chain):
            problems.append(("fallback_provisioning", list(self.fallback_provisioning), "a model is listed twice"))
        if "flex-start" in chain:
            if duration is None:
                problems.append(("max_run_duration", None, "flex-start needs one; allowed: a duration up to 7d"))
            elif duration > FLEX_START_MAX:
                problems.append(("max_run_duration", self.max_run_duration, "flex-start allows at most 7d"))
            elif duration < FLEX_START_MIN:
                problems.append(
                    (
                        "max_run_duration",
                        self.max_run_duration,
                        "flex-start runs at least 10 minutes; allowed: 10m to 7d",
                    )
                )
            if self.termination_action != "DELETE":
                problems.append(
                    ("termination_action", self.termination_action, "flex-start capacity is returned; allowed: DELETE")
                )
        elif duration is not None and self.provisioning in ("guaranteed", "reserved"):
            problems.append(
                (
                    "max_run_duration",
                    self.max_run_duration,
                    f"{self.provisioning} capacity has no run limit; allowed with standard, spot, flex-start",
                )
            )
        if "reserved" in chain and not self.reservation:
            problems.append(("reservation", None, "provisioning 'reserved' needs a reservation name"))
        if self.reservation and "reserved" not in chain:
            problems.append(("reservation", self.reservation, "only with provisioning: reserved"))
        if self.reservation and self.reservation.startswith("projects/"):
            match = re.match(r"^projects/[^/]+/locations/([^/]+)/reservations/[^/]+$", self.reservation)
            if not match or match.group(1) not in self.zones:
                problems.append(
                    (
                        "reservation",
                        self.reservation,
                        "allowed: a name, or projects/P/locations/ZONE/reservations/NAME with ZONE in cloud.zones",
                    )
                )
        # Judged by the address space the ranges add up to (0.0.0.0/1 + 128.0.0.0/1 is the internet).
        if opens_the_internet(self.serving_port_cidrs) and not self.allow_public_serving:
            problems.append(
                (
                    "serving_port_cidrs",
                    list(self.serving_port_cidrs),
                    f"{', '.join(self.serving_port_cidrs)} opens the serving port to the internet"
                    f" ({internet_share(self.serving_port_cidrs):.0%} of its addresses); allowed: narrower ranges,"
                    " or set allow_public_serving: true",
                )
            )
        if len(self.regions) + 1 > 2 ** (20 - ipaddress.IPv4Network(self.network.cidr).prefixlen):
            problems.append(("network.cidr", self.network.cidr, f"too small for {len(self.regions)} regions of /20"))
        if problems:
            raise SpecError([f"cloud.{field} = {value!r}: {why}" for field, value, why in problems])
        return self

    @property
    def regions(self) -> tuple[str, ...]:
        """Regions of the zones, in first-seen order (one subnet, router and NAT each)."""
        return tuple(dict.fromkeys(_ZONE.match(z).group(1) for z in self.zones))

    @property
    def provisioning_chain(self) -> tuple[str, ...]:
        return (self.provisioning, *self.fallback_provisioning)

    @property
    def create_wait_seconds(self) -> int:
        return int(parse_duration(self.create_wait).total_seconds())

    @property
    def recycle_before_seconds(self) -> int:
        return int(parse_duration(self.recycle_before).total_seconds())

    @property
    def max_run_seconds(self) -> int | None:
        return int(parse_duration(self.max_run_duration).total_seconds()) if self.max_run_duration else None

    @property
    def valid_until_seconds(self) -> int | None:
        return int(parse_duration(self.valid_until).total_seconds()) if self.valid_until else None


def parse_cloud(data: Any, source: str = "gemmaserve:cloud") -> Cloud:
    """Validate the `gemmaserve:cloud` mapping, or raise SpecError naming every field, value and what is allowed."""
    return validate_model(Cloud, data, source, prefix=("cloud",), expected="with at least `zones`")


@dataclass(frozen=True)
class Settings:
    """Everything the program declares from: validated spec, its plan and the cloud settings."""

    project: str
    region: str
    stack: str
    spec: Spec
    plan: Plan
    cloud: Cloud
    # The TPU type or GCE machine type the plan runs on (exactly one is set).
    tpu_type: TpuType | None
    machine_type: GcpMachineType | None

    @property
    def labels(self) -> dict[str, str]:
        base = {
            "app": "gemmaserve",
            "managed-by": "pulumi",
            "stack": re.sub(r"[^a-z0-9_-]", "-", self.stack.lower())[:63],
            "model": self.spec.model_info.aliases[0],
            "accelerator": self.spec.accelerator_info.name,
        }
        return {**base, **self.cloud.labels}

    @property
    def name(self) -> str:
        """Prefix for this stack's cloud resource names: short, lowercase, unique per stack (stack_prefix)."""
        return stack_prefix(self.stack)

    @property
    def repository_id(self) -> str:
        """The Artifact Registry repository: the stack's own unless one is named."""
        return self.cloud.image.repository or self.name

    @property
    def tpu_data_disk(self) -> dict[str, Any] | None:
        """TPU: the node's data disk, {type, size_gb} (None: not a TPU stack, or weights_disk.type none).
        Sized from the plan (checkpoint + engine + caches, with a margin) unless weights_disk.size_gb is set."""
        if self.tpu_type is None or self.cloud.weights_disk.type == "none":
            return None
        disk = self.cloud.weights_disk
        kind = disk.type if "type" in disk.model_fields_set else TPU_DATA_DISK_TYPES[self.spec.accelerator_info.name][0]
        if "size_gb" in disk.model_fields_set:
            return {"type": kind, "size_gb": disk.size_gb}
        model = self.spec.model_info
        weights = (model.checkpoint_bytes + (model.mtp_assistant_bytes or 0)) / 2**30
        needed = (weights + TPU_DISK_ENGINE_GIB + TPU_DISK_CACHES_GIB) * TPU_DISK_MARGIN
        return {"type": kind, "size_gb": max(50, math.ceil(needed / 10) * 10)}

    @property
    def flex_start_zones(self) -> tuple[str, ...] | None:
        """TPU: the zones of cloud.zones that sell flex-start for this TPU (None: not a TPU stack)."""
        if self.tpu_type is None:
            return None
        sold = TPU_FLEX_START_ZONES.get(self.spec.accelerator_info.name, ())
        return tuple(z for z in self.cloud.zones if z in sold)


def created_bucket(raw: dict[str, Any]) -> str | None:
    """The bucket a stack's `gemmaserve:` keys make it create: weights.bucket with source bucket, unless
    cloud.weights_bucket.create is false (read leniently: another stack's file may not validate)."""
    weights, cloud = raw.get("weights"), raw.get("cloud")
    if not isinstance(weights, dict) or weights.get("source") != "bucket" or not isinstance(weights.get("bucket"), str):
        return None
    bucket_config = cloud.get("weights_bucket") if isinstance(cloud, dict) else None
    if isinstance(bucket_config, dict) and bucket_config.get("create") is False:
        return None
    return weights["bucket"].removeprefix("gs://").partition("/")[0]


def other_stacks_creating(bucket: str, stack: str, project_dir: Path) -> list[str]:
    """The other stacks of this project (Pulumi.<stack>.yaml beside Pulumi.yaml) that create `bucket` too.
    Bucket names are global: only one stack can create it, the others use it with create: false."""
    others = []
    for path in sorted(project_dir.glob("Pulumi.*.yaml")):
        other = path.name.removeprefix("Pulumi.").removesuffix(".yaml")
        if other == stack:
            continue
        try:
            raw = read_stack_config(other, project_dir)
        except (SpecError, OSError, ValueError):
            continue  # that stack's own `up` reports its errors
        if created_bucket(raw) == bucket:
            others.append(other)
    return others


def settings_from_config(
    raw: dict[str, Any],
    gcp: dict[str, Any],
    stack: str,
    source: str | None = None,
    project_dir: Path | None = None,
) -> Settings:
    """Validate spec + cloud + gcp provider settings together; nothing is declared before this returns.
    With `project_dir`, the other stack files there are read too, for what two stacks cannot both create."""
    source = source or f"stack {stack}"
    problems: list[str] = []
    spec = cloud = None
    try:
        # Secrets named as this stack creates them (gs-STACK-NAME): the plan, the program and the hosts agree.
        spec = spec_from_config(stack_scoped_secrets(stack, {k: v for k, v in raw.items() if k in SPEC_KEYS}), source)
    except SpecError as error:
        problems += error.problems
    try:
        cloud = parse_cloud(raw.get("cloud"), source)
    except SpecError as error:
        problems += error.problems
    project, region = gcp.get("project"), gcp.get("region")
    if not project or not _PROJECT.match(str(project)):
        problems.append(
            f"gcp:project = {project!r}: required; allowed: a project id (pulumi config set gcp:project ID)"
        )
    if spec is not None and cloud is not None:
        problems += _cross_problems(spec, cloud, region)
    bucket = created_bucket(raw)
    if bucket and project_dir is not None:
        others = other_stacks_creating(bucket, stack, project_dir)
        if others:
            problems.append(
                f"weights.bucket = gs://{bucket}: stack(s) {', '.join(others)} create it too, and a bucket name "
                "exists once; allowed: cloud.weights_bucket.create: false in every stack but the one that owns it"
            )
    if problems:
        raise SpecError(problems, source)
    serving_plan = plan(spec).require_ok()
    acc, count = spec.accelerator_info, spec.accelerator.count
    return Settings(
        project=project,
        region=region or cloud.regions[0],
        stack=stack,
        spec=spec,
        plan=serving_plan,
        cloud=cloud,
        tpu_type=acc.tpu_type_for(count) if acc.is_tpu else None,
        machine_type=acc.machine_type_for(count) if acc.is_gpu else None,
    )


def _cross_problems(spec: Spec, cloud: Cloud, region: str | None) -> list[str]:
    acc, count = spec.accelerator_info, spec.accelerator.count
    problems = []
    if acc.is_tpu:
        if "flex-start" in cloud.provisioning_chain:
            sold = TPU_FLEX_START_ZONES.get(acc.name, ())
            where = "every zone" if cloud.provisioning == "flex-start" else "at least one zone"
            offered = [z for z in cloud.zones if z in sold]
            unsold = [z for z in cloud.zones if z not in sold]
            if (cloud.provisioning == "flex-start" and unsold) or not offered:
                problems.append(
                    f"cloud.zones = {list(unsold or cloud.zones)!r}: flex-start {acc.name} is not sold there and"
                    f" {where} must sell it; allowed: {', '.join(sold) or 'none (no flex-start for ' + acc.name + ')'}"
                    " (https://cloud.google.com/tpu/docs/request-using-flex-start)"
                )
        if acc.tpu_type_for(count) is None:
            problems.append(
                f"accelerator.count = {count}: no {acc.name} TPU type has {count} chips; allowed: "
                f"{', '.join(str(t.chips) for t in acc.tpu_types)}"
            )
        if cloud.hosts != 1:
            problems.append(f"cloud.hosts = {cloud.hosts}: a TPU stack is one queued slice; allowed: 1")
        if acc.name in GKE_ONLY_TPUS:
            problems.append(
                f"accelerator.kind = {acc.name!r}: Ironwood (TPU7x) is offered through GKE and Compute Engine TPU "
                "machine types, not as the Cloud TPU queued resources this program requests; allowed: "
                f"{', '.join(k for k in TPU_KINDS if k not in GKE_ONLY_TPUS)} ({GKE_ONLY_TPUS[acc.name]})"
            )
        takes = TPU_DATA_DISK_TYPES.get(acc.name, ())
        disk_type = cloud.weights_disk.type
        if "type" in cloud.weights_disk.model_fields_set and disk_type != "none" and disk_type not in takes:
            problems.append(
                f"cloud.weights_disk.type = {disk_type!r}: a {acc.name} VM attaches {', '.join(takes)} as its data"
                f" disk; allowed: {', '.join(takes)}, none (https://cloud.google.com/tpu/docs/attach-durable-block-storage)"
            )
    elif acc.is_gpu:
        if not acc.gcp_machine_types:
            problems.append(
                f"accelerator.kind = {acc.name!r}: not sold on Google Cloud; allowed: "
                "a100-40gb, a100-80gb, h100-80gb, h200, b200, rtx-pro-6000, l4, tpu-*"
            )
        elif acc.machine_type_for(count) is None:
            problems.append(
                f"accelerator.count = {count}: no {acc.name} machine type has {count} GPUs; allowed: "
                f"{', '.join(str(m.count) for m in acc.gcp_machine_types)}"
            )
        if cloud.provisioning == "guaranteed":
            problems.append(
                "cloud.provisioning = 'guaranteed': a TPU queued-resource tier; allowed for GPU VMs: "
                "standard, spot, reserved, flex-start"
            )
        if cloud.fallback_provisioning:
            problems.append(
                f"cloud.fallback_provisioning = {list(cloud.fallback_provisioning)!r}: a TPU queue fallback; GPU VMs"
                " are declared with one provisioning model; allowed: unset"
            )
        machine = acc.machine_type_for(count) if acc.gcp_machine_types else None
        series = machine.name.split("-")[0] if machine else ""
        if series in NO_FLEX_START_SERIES and cloud.provisioning == "flex-start":
            problems.append(
                f"cloud.provisioning = 'flex-start': {machine.name} ({series.upper()}) is not sold as flex-start;"
                " allowed: standard, spot, reserved (https://cloud.google.com/compute/docs/instances/about-flex-start-vms)"
            )
        if series in HYPERDISK_ONLY_SERIES:
            if not cloud.boot_disk_type.startswith("hyperdisk"):
                problems.append(
                    f"cloud.boot_disk_type = {cloud.boot_disk_type!r}: {series.upper()} attaches Hyperdisk only;"
                    " allowed: hyperdisk-balanced"
                )
            if cloud.weights_disk.type.startswith("pd-"):
                problems.append(
                    f"cloud.weights_disk.type = {cloud.weights_disk.type!r}: {series.upper()} attaches Hyperdisk only;"
                    " allowed: hyperdisk-balanced, local-ssd, none"
                )
        if cloud.valid_until or cloud.valid_after:
            problems.append("cloud.valid_until/valid_after: TPU queueing policy only; allowed for GPU VMs: unset")
    else:
        problems.append(
            f"accelerator.kind = {acc.name!r}: the Pulumi program provisions GPUs and TPUs; cpu hosts are the sandbox's"
        )
    # Hosts the stack provisions read their API keys and certificate from the stack's Secret Manager secrets.
    for field_name, source in (("api_keys", spec.serving.api_keys), ("tls", spec.serving.tls)):
        if source.secret_manager is None:
            problems.append(
                f"serving.{field_name}.file = {source.file!r}: hosts this stack provisions read it from Secret Manager; "
                f"allowed: serving.{field_name}.secret_manager (a secret name such as {field_name.replace('_', '-')}, "
                "created as gs-STACK-NAME)"
            )
    if region and any(r != region for r in cloud.regions) and not acc.is_tpu:
        problems.append(f"cloud.zones = {list(cloud.zones)!r}: GPU hosts must be in gcp:region {region}")
    return problems


def read_settings(project_dir: Path) -> Settings:
    """The current stack's config, validated (raises SpecError before any resource is declared); the other
    stack files in `project_dir` (Pulumi.yaml's directory) are read for what two stacks cannot both create."""
    import pulumi  # here, so the schema above imports without the Pulumi runtime

    config = pulumi.Config(NAMESPACE)
    # `model` is a plain string (26b-a4b); the other keys are YAML mappings, i.e. JSON objects.
    raw = {key: config.get_object(key) for key in SPEC_KEYS + ("cloud",) if key != "model"}
    raw["model"] = config.get("model")
    gcp = pulumi.Config("gcp")
    return settings_from_config(
        {k: v for k, v in raw.items() if v is not None},
        {"project": gcp.get("project"), "region": gcp.get("region")},
        pulumi.get_stack(),
        project_dir=project_dir,
    )


def read_hf_token():
    """`pulumi config set --secret hfToken`: an Output marked secret, or None when unset."""
    import pulumi

    return pulumi.Config(NAMESPACE).get_secret("hfToken")
