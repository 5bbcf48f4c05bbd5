"""GpuVm: one Compute Engine GPU host: machine type from the catalog, private, scheduled as configured."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp

from gemmaserve.cloud.config import CLOUD_PLATFORM_SCOPE

# Local SSDs Compute Engine attaches by itself (375 GB NVMe each) to every A2 Ultra, A3 and A4 machine type;
# G2 and G4 get none unless asked (https://cloud.google.com/compute/docs/disks/local-ssd#lssd_disks_fixed,
# https://cloud.google.com/compute/docs/disks/add-local-ssd). The provider reads them back into
# scratch_disks, which is ForceNew (terraform-provider-google resource_compute_instance.go, #19648), so they
# are declared: a program that declares what Google attaches has no diff on the next `up`. ignore_changes
# would hide the diff but leave the program saying the VM has no (or one) local SSD when it has sixteen,
# and local-ssd weights would still ask for a count the machine type does not take.
BUNDLED_LOCAL_SSDS = {
    "a2-ultragpu-1g": 1,
    "a2-ultragpu-2g": 2,
    "a2-ultragpu-4g": 4,
    "a2-ultragpu-8g": 8,
    "a3-highgpu-1g": 2,
    "a3-highgpu-2g": 4,
    "a3-highgpu-4g": 8,
    "a3-highgpu-8g": 16,
    "a3-megagpu-8g": 16,
    "a3-ultragpu-8g": 32,
    "a4-highgpu-8g": 32,
}
LOCAL_SSD_GB = 375
# Third-generation and later machine series take gVNIC, not VirtIO-Net
# (https://cloud.google.com/compute/docs/networking/using-gvnic); A2 and G2 take either and keep the default.
GVNIC_SERIES = ("a3", "a4", "g4")


def nic_type(machine_type: str) -> str | None:
    return "GVNIC" if machine_type.split("-")[0] in GVNIC_SERIES else None


PROVISIONING_MODEL = {"standard": "STANDARD", "reserved": "STANDARD", "spot": "SPOT", "flex-start": "FLEX_START"}


@dataclass
class GpuVmArgs:
    zone: str
    machine_type: str
    # Every catalog machine type (a2/a3/a4/g2/g4) carries its GPUs: no guest_accelerators are declared.
    subnetwork: pulumi.Input[str]
    service_account: pulumi.Input[str]
    boot_image: str
    boot_disk_type: str = "pd-balanced"
    boot_disk_gb: int = 100
    weights_disk_type: str = "pd-balanced"
    weights_disk_gb: int = 500
    local_ssd_count: int = 1
    provisioning: str = "standard"
    max_run_seconds: int | None = None
    termination_action: str = "DELETE"
    reservation: str | None = None
    allow_external_ip: bool = False
    # Flex-start requests wait in the queue; the instance's create must outlast that (config.FLEX_START_VM_CREATE_TIMEOUT).
    create_timeout: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)


def scheduling(args: GpuVmArgs) -> gcp.compute.InstanceSchedulingArgs:
    """GPU hosts cannot live-migrate, so host maintenance terminates them (and standard ones restart)."""
    model = PROVISIONING_MODEL[args.provisioning]
    stoppable = model in ("SPOT", "FLEX_START") or args.max_run_seconds is not None
    return gcp.compute.InstanceSchedulingArgs(
        on_host_maintenance="TERMINATE",
        automatic_restart=model == "STANDARD",
        preemptible=model == "SPOT",
        provisioning_model=model,
        instance_termination_action=args.termination_action if stoppable else None,
        max_run_duration=gcp.compute.InstanceSchedulingMaxRunDurationArgs(seconds=args.max_run_seconds)
        if args.max_run_seconds
        else None,
    )


def reservation_affinity(args: GpuVmArgs) -> gcp.compute.InstanceReservationAffinityArgs:
    if args.provisioning == "reserved":
        return gcp.compute.InstanceReservationAffinityArgs(
            type="SPECIFIC_RESERVATION",
            specific_reservation=gcp.compute.InstanceReservationAffinitySpecificReservationArgs(
                key="compute.googleapis.com/reservation-name", values=[args.reservation]
            ),
        )
    # Spot and flex-start capacity never comes out of a reservation (flex-start requires this).
    return gcp.compute.InstanceReservationAffinityArgs(
        type="ANY_RESERVATION" if args.provisioning == "standard" else "NO_RESERVATION"
    )


class GpuVm(pulumi.ComponentResource):
    """A GPU instance with a boot disk, a weights/cache disk, no external IP by default, and labels."""

    def __init__(self, name: str, args: GpuVmArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:GpuVm", name, None, opts)
        # Children wait for what the component waits for (the project's APIs): Pulumi does not pass depends_on down.
        child = pulumi.ResourceOptions(parent=self, depends_on=opts.depends_on if opts else None)
        attached = []
        bundled = BUNDLED_LOCAL_SSDS.get(args.machine_type)
        ssds = bundled or (args.local_ssd_count if args.weights_disk_type == "local-ssd" else 0)
        scratch = [gcp.compute.InstanceScratchDiskArgs(interface="NVME", size=LOCAL_SSD_GB) for _ in range(ssds)]
        # On machine types with a bundle, local-ssd weights use the bundle (local_ssd_count is not asked for).
        if args.weights_disk_type not in ("local-ssd", "none"):
            disk = gcp.compute.Disk(
                f"{name}-weights",
                zone=args.zone,
                type=args.weights_disk_type,
                size=args.weights_disk_gb,
                labels=args.labels,
                opts=child,
            )
            attached = [gcp.compute.InstanceAttachedDiskArgs(source=disk.id, device_name="weights")]
        self.instance = gcp.compute.Instance(
            f"{name}",
            zone=args.zone,
            machine_type=args.machine_type,
            boot_disk=gcp.compute.InstanceBootDiskArgs(
                initialize_params=gcp.compute.InstanceBootDiskInitializeParamsArgs(
                    image=args.boot_image, size=args.boot_disk_gb, type=args.boot_disk_type
                )
            ),
            attached_disks=attached,
            scratch_disks=scratch,
            network_interfaces=[
                gcp.compute.InstanceNetworkInterfaceArgs(
                    subnetwork=args.subnetwork,
                    nic_type=nic_type(args.machine_type),
                    # An empty access config asks for an ephemeral public IP; none means private only.
                    access_configs=[gcp.compute.InstanceNetworkInterfaceAccessConfigArgs()]
                    if args.allow_external_ip
                    else [],
                )
            ],
            service_account=gcp.compute.InstanceServiceAccountArgs(
                email=args.service_account, scopes=[CLOUD_PLATFORM_SCOPE]
            ),
            scheduling=scheduling(args),
            reservation_affinity=reservation_affinity(args),
            shielded_instance_config=gcp.compute.InstanceShieldedInstanceConfigArgs(
                enable_integrity_monitoring=True, enable_vtpm=True
            ),
            # SSH arrives through IAP only (firewall); keys or OS Login come from project settings, and
            # cloud.ssh_user names the account the inventories log in as.
            labels=args.labels,
            tags=args.tags,
            allow_stopping_for_update=True,
            # A spot VM stopped by preemption (termination_action STOP) is started again by the next
            # `pulumi up --refresh` (what `gemmaserve capacity watch` runs): refresh sees it TERMINATED.
            desired_status="RUNNING",
            opts=pulumi.ResourceOptions.merge(
                child, pulumi.ResourceOptions(custom_timeouts=pulumi.CustomTimeouts(create=args.create_timeout))
            )
            if args.create_timeout
            else child,
        )
        self.zone = pulumi.Output.from_input(args.zone)
        self.internal_ip = self.instance.network_interfaces.apply(lambda nics: nics[0].network_ip)
        self.external_ip = self.instance.network_interfaces.apply(
            lambda nics: nics[0].access_configs[0].nat_ip if nics[0].access_configs else None
        )
        self.register_outputs({"internal_ip": self.internal_ip, "zone": self.zone})
