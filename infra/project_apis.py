"""ProjectApis: the Google APIs and service agents a stack needs, enabled before any resource uses them.

A fresh project has none of them on: without this, the first `pulumi up` fails half way (the VPC
before compute is on, the queued resource before the TPU API and its service agent exist) and leaves
partial state. Every other component of the program depends on this one (`depends_on`), so nothing
races the enablement. APIs stay enabled when a stack is destroyed: other stacks of the project may use
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

# What each API is needed for in every stack.
BASE_APIS = {
    "compute.googleapis.com": "VPC, firewalls, Cloud NAT, GPU VMs, load balancer",
    "iam.googleapis.com": "the hosts' service account",
    "cloudresourcemanager.googleapis.com": "project-level IAM bindings",
    "secretmanager.googleapis.com": "the Hugging Face token, the API keys, the TLS certificate",
    "artifactregistry.googleapis.com": "the serving image repository",
    "iap.googleapis.com": "SSH to hosts without public IPs (IAP TCP forwarding)",
}
TPU_API = "tpu.googleapis.com"
# JSON API for Cloud Storage buckets (https://cloud.google.com/storage/docs/json_api): on by default in
# most new projects, not in all (an organization policy or an earlier disable can turn it off).
STORAGE_API = "storage.googleapis.com"


@dataclass
class ProjectApisArgs:
    project: str
    # TPU stacks also need the TPU API and its service agent (it creates the TPU VMs).
    tpu: bool = False
    # A stack whose hosts load weights from a bucket (creating it or only granting its hosts) needs Cloud Storage's API.
    storage: bool = False


def required_apis(tpu: bool, storage: bool = False) -> dict[str, str]:
    apis = dict(BASE_APIS)
    if tpu:
        apis[TPU_API] = "TPU queued resources and TPU VMs"
    if storage:
        apis[STORAGE_API] = "the weights bucket and its hosts' IAM bindings"
    return apis


class ProjectApis(pulumi.ComponentResource):
    """One projects.Service per API (never disabled on destroy) and the TPU service agent."""

    def __init__(self, name: str, args: ProjectApisArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:ProjectApis", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.services = {
            api: gcp.projects.Service(
                f"{name}-{api.split('.')[0]}",
                project=args.project,
                service=api,
                # Another stack in this project may rely on it; disabling would break that stack.
                disable_on_destroy=False,
                disable_dependent_services=False,
                opts=child,
            )
            for api in required_apis(args.tpu, args.storage)
        }
        self.tpu_agent = None
        if args.tpu:
            # The Cloud TPU service agent (service-PROJECT_NUMBER@cloud-tpu.iam.gserviceaccount.com) is made
            # on first use; creating it here, after the API, means the first queued resource never waits
            # on it. Google grants it its default role when it is generated.
            self.tpu_agent = gcp.projects.ServiceIdentity(
                f"{name}-tpu-agent",
                project=args.project,
                service=TPU_API,
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.services[TPU_API]]),
            )
        self.register_outputs({"apis": list(self.services)})
