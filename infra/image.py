"""ServingImage: the Artifact Registry repository and, optionally, a pinned serving image built into it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_gcp as gcp

from gemmaserve.plan import CHAT_TEMPLATE_PATH, CHAT_TEMPLATE_URL

READER_ROLE = "roles/artifactregistry.reader"
# vLLM base image + pinned transformers + the Gemma 4 tool chat template, so hosts never build at start.
DOCKERFILE_DIR = Path(__file__).parent / "serving_image"


@dataclass
class ServingImageArgs:
    project: str
    location: str
    repository_id: str
    reader_member: pulumi.Input[str]
    build: bool = False
    base_image: str | None = None
    vllm_package: str = "vllm"
    vllm_version: str | None = None
    transformers_version: str | None = None
    # ADD --checksum: the template is verified at build time (gemmaserve.engines records it per release).
    chat_template_sha256: str = ""
    labels: dict[str, str] = field(default_factory=dict)


class ServingImage(pulumi.ComponentResource):
    """Docker repository, reader binding for the hosts, and the optional pulumi-docker build."""

    def __init__(self, name: str, args: ServingImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:ServingImage", name, None, opts)
        # Children wait for what the component waits for (the project's APIs): Pulumi does not pass depends_on down.
        child = pulumi.ResourceOptions(parent=self, depends_on=opts.depends_on if opts else None)
        self.repository = gcp.artifactregistry.Repository(
            f"{name}-repo",
            project=args.project,
            location=args.location,
            repository_id=args.repository_id,
            format="DOCKER",
            description="gemmaserve serving images (pinned vLLM + transformers)",
            docker_config=gcp.artifactregistry.RepositoryDockerConfigArgs(immutable_tags=True),
            labels=args.labels,
            opts=child,
        )
        gcp.artifactregistry.RepositoryIamMember(
            f"{name}-reader",
            project=args.project,
            location=args.location,
            repository=self.repository.name,
            role=READER_ROLE,
            member=args.reader_member,
            opts=child,
        )
        registry = f"{args.location}-docker.pkg.dev"
        self.repository_url = pulumi.Output.concat(registry, "/", args.project, "/", self.repository.repository_id)
        self.image_ref: pulumi.Output[str] | None = None
        if args.build:
            if not (args.transformers_version and args.chat_template_sha256):
                raise ValueError(
                    f"image.build: vLLM {args.vllm_version} has no pinned transformers or recorded chat template "
                    "checksum in gemmaserve.engines; set engine.transformers_version or build with a pinned release"
                )
            import pulumi_docker as docker  # only stacks that build need the Docker provider

            tag = f"vllm-{args.vllm_version}-tf-{args.transformers_version}"
            token = gcp.organizations.get_client_config_output().access_token
            image = docker.Image(
                f"{name}-serving",
                image_name=pulumi.Output.concat(self.repository_url, "/vllm-gemma4:", tag),
                build=docker.DockerBuildArgs(
                    context=str(DOCKERFILE_DIR),
                    dockerfile=str(DOCKERFILE_DIR / "Dockerfile"),
                    platform="linux/amd64",
                    args={
                        "BASE_IMAGE": args.base_image,
                        "VLLM_PACKAGE": args.vllm_package,
                        "VLLM_VERSION": args.vllm_version,
                        "TRANSFORMERS_VERSION": args.transformers_version,
                        "CHAT_TEMPLATE_URL": CHAT_TEMPLATE_URL.format(version=args.vllm_version),
                        "CHAT_TEMPLATE_SHA256": args.chat_template_sha256,
                        "CHAT_TEMPLATE_PATH": CHAT_TEMPLATE_PATH,
                    },
                ),
                registry=docker.RegistryArgs(
                    server=registry, username="oauth2accesstoken", password=pulumi.Output.secret(token)
                ),
                opts=child,
            )
            # The digest pins what hosts run, even if someone pushes the same tag elsewhere.
            self.image_ref = image.repo_digest
        self.register_outputs({"repository_url": self.repository_url, "image": self.image_ref})
