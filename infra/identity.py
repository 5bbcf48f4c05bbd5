"""Identity: one service account per stack holding only what serving hosts need."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# Project-wide roles hosts need: ship logs and metrics. Secret access and image pulls are granted on
# the one secret and the one repository (HfTokenSecret, ServingImage), not project-wide.
HOST_PROJECT_ROLES = ("roles/logging.logWriter", "roles/monitoring.metricWriter")


@dataclass
class IdentityArgs:
    project: str
    account_id: str
    stack: str


class Identity(pulumi.ComponentResource):
    """The hosts' service account and its project-level log and metric writer roles."""

    def __init__(self, name: str, args: IdentityArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:Identity", name, None, opts)
        # Children wait for what the component waits for (the project's APIs): Pulumi does not pass depends_on down.
        child = pulumi.ResourceOptions(parent=self, depends_on=opts.depends_on if opts else None)
        self.account = gcp.serviceaccount.Account(
            f"{name}-sa",
            project=args.project,
            account_id=args.account_id,
            display_name=f"gemmaserve hosts ({args.stack})",
            opts=child,
        )
        self.email = self.account.email
        self.member = self.account.email.apply(lambda email: f"serviceAccount:{email}")
        for role in HOST_PROJECT_ROLES:
            gcp.projects.IAMMember(
                f"{name}-{role.split('/')[-1]}", project=args.project, role=role, member=self.member, opts=child
            )
        self.register_outputs({"email": self.email})
