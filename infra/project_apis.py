"""ProjectApis: the Google APIs and service agents a stack needs, enabled before any resource uses them.

A fresh project has none of them on: without this, the first `pulumi up` fails half way (the VPC
before compute is on, the queued resource before the TPU API and its service agent exist) and leaves
partial state. Every other component of the program depends on this one (`depends_on`), and through it
on a wait after the enablement (EnablementWait), so nothing races the enablement. APIs stay enabled when a stack is destroyed: other stacks of the project may use
them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_gcp as gcp
from pulumi.dynamic import CreateResult, DiffResult, Resource, ResourceProvider

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


# Enabling an API is eventually consistent: projects.Service returns once Service Usage lists the API as
# enabled, and calls to it can still get 403 "API has not been used in project ... or it is disabled" for
# a while after. terraform-provider-google's own guide says there is no way to verify activation and waits
# a fixed time after the enablement (hashicorp/terraform-provider-google, website/docs/guides/
# google_project_service.html.markdown, "Newly activated service errors", with the time provider's
# time_sleep). How long: our choice; the TPU provider also retries SERVICE_DISABLED for longer.
ENABLEMENT_WAIT_SECONDS = 90


class EnablementWaitProvider(ResourceProvider):
    """time_sleep's create_duration as a dynamic provider: create waits, nothing else ever does.

    Created when the stack first enables its APIs and replaced (so waiting again) when the list grows;
    a later `up` with the same APIs has no diff and no wait.
    """

    def __init__(self, sleep: Callable[[float], None] = time.sleep):
        super().__init__()
        self.sleep = sleep

    def create(self, props: dict[str, Any]) -> CreateResult:
        self.sleep(float(props["seconds"]))
        return CreateResult(id_="enablement-wait", outs=props)

    def diff(self, id_: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        added = sorted(set(news.get("apis") or []) - set(olds.get("apis") or []))
        return DiffResult(changes=bool(added), replaces=["apis"] if added else [], delete_before_replace=False)


class EnablementWait(Resource, module="gemmaserve", name="EnablementWait"):
    """Waits ENABLEMENT_WAIT_SECONDS after the APIs it depends on were enabled."""

    def __init__(self, name: str, apis: list[str], seconds: float, opts: pulumi.ResourceOptions | None = None):
        super().__init__(EnablementWaitProvider(), name, {"apis": sorted(apis), "seconds": seconds}, opts)


@dataclass
class ProjectApisArgs:
    project: str
    # TPU stacks also need the TPU API and its service agent (it creates the TPU VMs).
    tpu: bool = False
    # A stack whose hosts load weights from a bucket (creating it or only granting its hosts) needs Cloud Storage's API.
    storage: bool = False
    enablement_wait_seconds: float = ENABLEMENT_WAIT_SECONDS


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
        # Everything that depends on this component depends on its children, this wait included: no resource
        # is created before the enablement had time to reach the APIs.
        self.enablement_wait = EnablementWait(
            f"{name}-enabled",
            list(self.services),
            args.enablement_wait_seconds,
            pulumi.ResourceOptions(
                parent=self, depends_on=list(self.services.values()) + ([self.tpu_agent] if self.tpu_agent else [])
            ),
        )
        self.register_outputs({"apis": list(self.services)})
