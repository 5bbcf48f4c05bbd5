"""The weights bucket: one mirror per stack that hosts load weights (and compile caches) from."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp

# Hosts read everything (weights) and write only compile caches, which travel from host to host.
# IAM Conditions on object names: https://cloud.google.com/storage/docs/access-control/iam#conditions
HOST_READ_ROLE = "roles/storage.objectViewer"
HOST_CACHE_ROLE = "roles/storage.objectUser"
OPERATOR_ROLE = "roles/storage.objectAdmin"


@dataclass
class WeightsBucketArgs:
    project: str
    name: str
    location: str
    host_member: pulumi.Input[str]
    cache_prefix: str
    writers: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    force_destroy: bool = False
    # False: another stack owns the bucket (a name exists once); this stack only grants its own hosts.
    create: bool = True


def grant_model_read(
    name: str, uri: str, host_member: pulumi.Input[str], opts: pulumi.ResourceOptions | None = None
) -> gcp.storage.BucketIAMMember:
    """Read on the bucket of a gs:// model (the spec's model, streamed where it is) for the hosts' account: a
    non-authoritative member, so the bucket's other grants stay as its owner set them."""
    bucket = uri.removeprefix("gs://").split("/", 1)[0]
    return gcp.storage.BucketIAMMember(
        f"{name}-hosts-read", bucket=bucket, role=HOST_READ_ROLE, member=host_member, opts=opts
    )


class WeightsBucket(pulumi.ComponentResource):
    """A private bucket with uniform access: hosts read it (and write compile caches), operators write it."""

    def __init__(self, name: str, args: WeightsBucketArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:WeightsBucket", name, None, opts)
        # Children wait for what the component waits for (the project's APIs): Pulumi does not pass depends_on down.
        child = pulumi.ResourceOptions(parent=self, depends_on=opts.depends_on if opts else None)
        self.bucket = None
        if args.create:
            self.bucket = gcp.storage.Bucket(
                f"{name}-bucket",
                name=args.name,
                project=args.project,
                location=args.location,
                uniform_bucket_level_access=True,
                public_access_prevention="enforced",
                force_destroy=args.force_destroy,
                labels=args.labels,
                opts=child,
            )
        # Non-authoritative members: each stack sharing the bucket adds its own hosts, none removes another's.
        bucket = self.bucket.name if self.bucket is not None else pulumi.Output.from_input(args.name)
        gcp.storage.BucketIAMMember(
            f"{name}-hosts-read", bucket=bucket, role=HOST_READ_ROLE, member=args.host_member, opts=child
        )
        gcp.storage.BucketIAMMember(
            f"{name}-hosts-cache",
            bucket=bucket,
            role=HOST_CACHE_ROLE,
            member=args.host_member,
            condition=gcp.storage.BucketIAMMemberConditionArgs(
                title="compile caches only",
                description="Hosts may write compile caches, never weights",
                expression=(f'resource.name.startsWith("projects/_/buckets/{args.name}/objects/{args.cache_prefix}")'),
            ),
            opts=child,
        )
        for index, member in enumerate(args.writers):
            gcp.storage.BucketIAMMember(
                f"{name}-writer-{index}", bucket=bucket, role=OPERATOR_ROLE, member=member, opts=child
            )
        self.uri = bucket.apply(lambda bucket: f"gs://{bucket}")
        self.register_outputs({"uri": self.uri})
