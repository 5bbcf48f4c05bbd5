"""Network: a private VPC with one subnet per region (Private Google Access), Cloud NAT, and tight firewalls."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp

from gemmaserve.cloud.config import HEALTH_CHECK_RANGES, IAP_RANGE
from gemmaserve.plan import fleet_peer_port

# Hosts carry this tag; every firewall rule targets it, so nothing else in the VPC is opened.
HOST_TAG = "gemmaserve-host"


@dataclass
class NetworkArgs:
    regions: tuple[str, ...]
    cidr: str
    # HAProxy's port on every host: the one port clients (or the load balancer) reach.
    serving_port: int
    serving_cidrs: tuple[str, ...] = ()
    # Regional internal Application Load Balancer: needs a proxy-only subnet and health-check ranges.
    load_balancer_region: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


class Network(pulumi.ComponentResource):
    """VPC, subnets, router + NAT per region, and firewall rules for IAP SSH, serving and health checks."""

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:Network", name, None, opts)
        # Children wait for what the component waits for (the project's APIs): Pulumi does not pass depends_on down.
        child = pulumi.ResourceOptions(parent=self, depends_on=opts.depends_on if opts else None)
        ranges = list(ipaddress.IPv4Network(args.cidr).subnets(new_prefix=20))
        self.vpc = gcp.compute.Network(
            f"{name}-vpc", auto_create_subnetworks=False, routing_mode="REGIONAL", opts=child
        )
        self.subnets: dict[str, gcp.compute.Subnetwork] = {}
        for index, region in enumerate(args.regions):
            subnet = gcp.compute.Subnetwork(
                f"{name}-{region}",
                region=region,
                network=self.vpc.id,
                ip_cidr_range=str(ranges[index]),
                # Hosts have no public IP: Google APIs (Secret Manager, Artifact Registry) via PGA.
                private_ip_google_access=True,
                opts=child,
            )
            router = gcp.compute.Router(f"{name}-{region}-router", region=region, network=self.vpc.id, opts=child)
            # NAT for everything else (Hugging Face downloads, package mirrors) without public IPs.
            gcp.compute.RouterNat(
                f"{name}-{region}-nat",
                region=region,
                router=router.name,
                nat_ip_allocate_option="AUTO_ONLY",
                source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
                log_config=gcp.compute.RouterNatLogConfigArgs(enable=True, filter="ERRORS_ONLY"),
                opts=child,
            )
            self.subnets[region] = subnet
        gcp.compute.Firewall(
            f"{name}-ssh-from-iap",
            network=self.vpc.id,
            direction="INGRESS",
            source_ranges=[IAP_RANGE],
            allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=["22"])],
            target_tags=[HOST_TAG],
            opts=child,
        )
        if args.serving_cidrs:
            gcp.compute.Firewall(
                f"{name}-serving",
                network=self.vpc.id,
                direction="INGRESS",
                source_ranges=list(args.serving_cidrs),
                allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=[str(args.serving_port)])],
                target_tags=[HOST_TAG],
                opts=child,
            )
        self.proxy_subnet = None
        if args.load_balancer_region:
            self.proxy_subnet = gcp.compute.Subnetwork(
                f"{name}-lb-proxy",
                region=args.load_balancer_region,
                network=self.vpc.id,
                ip_cidr_range=str(ranges[-1]),
                purpose="REGIONAL_MANAGED_PROXY",
                role="ACTIVE",
                opts=child,
            )
            # The proxies forward from the proxy-only subnet; the probers from Google's health-check ranges.
            gcp.compute.Firewall(
                f"{name}-lb-to-hosts",
                network=self.vpc.id,
                direction="INGRESS",
                source_ranges=[str(ranges[-1]), *HEALTH_CHECK_RANGES],
                allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=[str(args.serving_port)])],
                target_tags=[HOST_TAG],
                opts=child,
            )
            # Several hosts behind the balancer route as one fleet: each forwards a conversation to the host that
            # owns it, on that host's peer port (docs/routing.md#across-hosts), from host to host only. A source
            # tag matches the primary internal address of the tagged VMs
            # (https://cloud.google.com/firewall/docs/firewalls, "Sources for ingress rules").
            gcp.compute.Firewall(
                f"{name}-fleet-peers",
                network=self.vpc.id,
                direction="INGRESS",
                source_tags=[HOST_TAG],
                allows=[gcp.compute.FirewallAllowArgs(protocol="tcp", ports=[str(fleet_peer_port(args.serving_port))])],
                target_tags=[HOST_TAG],
                opts=child,
            )
        self.register_outputs(
            {
                "network": self.vpc.id,
                "subnets": {region: subnet.id for region, subnet in self.subnets.items()},
            }
        )
