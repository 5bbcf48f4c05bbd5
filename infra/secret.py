"""The Hugging Face token in Secret Manager, readable by the hosts' service account only."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp

ACCESSOR_ROLE = "roles/secretmanager.secretAccessor"


@dataclass
class HfTokenSecretArgs:
    project: str
    # spec.secret.secret_manager: a NAME this stack creates, or projects/P/secrets/NAME owned elsewhere.
    secret: str
    accessor_member: pulumi.Input[str]
    replication: str | tuple[str, ...] = "automatic"
    # `pulumi config set --secret hfToken`: a secret Output; None leaves adding a version to an operator.
    token: pulumi.Output[str] | None = None
    labels: dict[str, str] = field(default_factory=dict)


class HfTokenSecret(pulumi.ComponentResource):
    """Secret (+ optional version) and the accessor binding; exports the secret's name, never its value."""

    def __init__(self, name: str, args: HfTokenSecretArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:HfTokenSecret", name, None, opts)
        # Children wait for what the component waits for (the project's APIs): Pulumi does not pass depends_on down.
        child = pulumi.ResourceOptions(parent=self, depends_on=opts.depends_on if opts else None)
        secret_path = args.secret.split("/versions/")[0]
        if secret_path.startswith("projects/"):
            # Owned elsewhere: bind the accessor only.
            self.secret_name: pulumi.Output[str] = pulumi.Output.from_input(secret_path)
            secret_id, project = secret_path.split("/")[3], secret_path.split("/")[1]
        else:
            if args.replication == "automatic":
                replication = gcp.secretmanager.SecretReplicationArgs(
                    auto=gcp.secretmanager.SecretReplicationAutoArgs()
                )
            else:
                replication = gcp.secretmanager.SecretReplicationArgs(
                    user_managed=gcp.secretmanager.SecretReplicationUserManagedArgs(
                        replicas=[
                            gcp.secretmanager.SecretReplicationUserManagedReplicaArgs(location=region)
                            for region in args.replication
                        ]
                    )
                )
            secret = gcp.secretmanager.Secret(
                f"{name}-secret",
                project=args.project,
                secret_id=secret_path,
                replication=replication,
                labels=args.labels,
                opts=child,
            )
            if args.token is not None:
                gcp.secretmanager.SecretVersion(
                    f"{name}-version",
                    secret=secret.id,
                    secret_data=pulumi.Output.secret(args.token),
                    opts=pulumi.ResourceOptions.merge(
                        child, pulumi.ResourceOptions(additional_secret_outputs=["secret_data"])
                    ),
                )
            self.secret_name = secret.name
            secret_id, project = secret.secret_id, args.project
        gcp.secretmanager.SecretIamMember(
            f"{name}-accessor",
            project=project,
            secret_id=secret_id,
            role=ACCESSOR_ROLE,
            member=args.accessor_member,
            opts=child,
        )
        self.register_outputs({"secret_name": self.secret_name})
