"""ServingLoadBalancer: a regional internal Application Load Balancer over every host's HAProxy, serving
HTTPS on a reserved address with a certificate the stack's CA signs, and speaking HTTPS to the hosts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp
from access import server_certificate

HEALTH_PATH = "/health"


@dataclass
class ServingLoadBalancerArgs:
    region: str
    network: pulumi.Input[str]
    subnetwork: pulumi.Input[str]
    # Instance self-links by zone: one unmanaged instance group per zone.
    instances_by_zone: dict[str, list[pulumi.Input[str]]]
    port: int
    # spec.serving.stream_timeout: as long as HAProxy lets a response run (its timeout client/server).
    timeout_seconds: int
    # The stack's CA (infra/access.py), which signs the certificate the balancer serves.
    ca_cert_pem: pulumi.Input[str]
    ca_private_key_pem: pulumi.Input[str]
    # The proxy-only subnet must exist before the forwarding rule.
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)


class ServingLoadBalancer(pulumi.ComponentResource):
    """Instance groups, HTTPS /health check, LEAST_REQUEST HTTPS backend service, URL map, reserved address,
    certificate, HTTPS proxy and private forwarding rule."""

    def __init__(self, name: str, args: ServingLoadBalancerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gemmaserve:gcp:ServingLoadBalancer", name, None, opts)
        # Children wait for what the component waits for (the project's APIs): Pulumi does not pass depends_on down.
        child = pulumi.ResourceOptions(parent=self, depends_on=opts.depends_on if opts else None)
        groups = [
            gcp.compute.InstanceGroup(
                f"{name}-{zone}",
                zone=zone,
                instances=instances,
                network=args.network,
                named_ports=[gcp.compute.InstanceGroupNamedPortArgs(name="https", port=args.port)],
                opts=child,
            )
            for zone, instances in args.instances_by_zone.items()
        ]
        health = gcp.compute.RegionHealthCheck(
            f"{name}-health",
            region=args.region,
            # A host that got a preemption notice drains and fails /health (roles/preemption); out of the
            # backend within ~10 s, well inside a spot VM's 30 s notice.
            check_interval_sec=5,
            timeout_sec=5,
            healthy_threshold=1,
            unhealthy_threshold=2,
            # HAProxy serves TLS only; /health needs no API key.
            https_health_check=gcp.compute.RegionHealthCheckHttpsHealthCheckArgs(
                port=args.port, request_path=HEALTH_PATH
            ),
            opts=child,
        )
        self.backend = gcp.compute.RegionBackendService(
            f"{name}-backend",
            region=args.region,
            # To each host's HAProxy over TLS (its certificate is signed by the same CA).
            protocol="HTTPS",
            port_name="https",
            load_balancing_scheme="INTERNAL_MANAGED",
            # Generation lengths vary by orders of magnitude: send each request to the least busy host.
            locality_lb_policy="LEAST_REQUEST",
            # The whole response time on a regional internal Application Load Balancer (30 s by default,
            # https://cloud.google.com/load-balancing/docs/l7-internal#timeouts_and_retries): as long as
            # HAProxy lets a stream run, so a long generation is not cut here while HAProxy still serves it.
            timeout_sec=args.timeout_seconds,
            health_checks=health.id,
            backends=[
                gcp.compute.RegionBackendServiceBackendArgs(
                    group=group.self_link, balancing_mode="UTILIZATION", capacity_scaler=1.0
                )
                for group in groups
            ],
            opts=child,
        )
        url_map = gcp.compute.RegionUrlMap(
            f"{name}-urls", region=args.region, default_service=self.backend.id, opts=child
        )
        # Reserved first: the certificate names the address before the forwarding rule takes it.
        address = gcp.compute.Address(
            f"{name}-address",
            region=args.region,
            subnetwork=args.subnetwork,
            address_type="INTERNAL",
            labels=args.labels,
            opts=child,
        )
        key, cert = server_certificate(
            f"{name}-tls", [address.address], args.ca_cert_pem, args.ca_private_key_pem, child
        )
        certificate = gcp.compute.RegionSslCertificate(
            f"{name}-certificate",
            region=args.region,
            certificate=pulumi.Output.concat(cert.cert_pem, args.ca_cert_pem),
            private_key=key.private_key_pem,
            opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["private_key"]),
        )
        proxy = gcp.compute.RegionTargetHttpsProxy(
            f"{name}-proxy", region=args.region, url_map=url_map.id, ssl_certificates=[certificate.id], opts=child
        )
        self.forwarding_rule = gcp.compute.ForwardingRule(
            f"{name}-rule",
            region=args.region,
            load_balancing_scheme="INTERNAL_MANAGED",
            ip_protocol="TCP",
            ip_address=address.address,
            port_range=str(args.port),
            target=proxy.id,
            network=args.network,
            subnetwork=args.subnetwork,
            labels=args.labels,
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=args.depends_on)),
        )
        self.address = address.address
        self.register_outputs({"address": self.address})
