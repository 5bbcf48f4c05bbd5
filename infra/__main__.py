"""The Pulumi program: validated stack config -> network, identity, secrets, image, TPU slice or GPU VMs -> hosts,
who may call them (API key secret, TLS) and, with several hosts, an HTTPS load balancer."""

from pathlib import Path

import pulumi
from access import EndpointAccess, EndpointAccessArgs
from gpu_vm import GpuVm, GpuVmArgs
from host_records import host_record
from identity import Identity, IdentityArgs
from image import ServingImage, ServingImageArgs
from load_balancer import ServingLoadBalancer, ServingLoadBalancerArgs
from network import HOST_TAG, Network, NetworkArgs
from project_apis import ProjectApis, ProjectApisArgs
from secret import HfTokenSecret, HfTokenSecretArgs
from tpu_slice import TpuSlice, TpuSliceArgs
from weights_bucket import WeightsBucket, WeightsBucketArgs, grant_model_read

from gemmaserve.cloud.config import FLEX_START_VM_CREATE_TIMEOUT, read_hf_token, read_settings

# Everything is validated before the first resource is declared: a bad stack fails here, whole.
# The project's other stack files are in Pulumi.yaml's directory, one up from this program.
settings = read_settings(Path(__file__).resolve().parents[1])
cloud, spec, serving_plan, name = settings.cloud, settings.spec, settings.plan, settings.name
labels = settings.labels
port = serving_plan.router_port
lb_region = settings.region if cloud.hosts > 1 else None

# A fresh project has no APIs on: enable them first, and make everything else wait for them.
weights = serving_plan.weights
apis = ProjectApis(
    f"{name}-apis",
    ProjectApisArgs(project=settings.project, tpu=settings.tpu_type is not None, storage=weights.from_bucket),
)
after_apis = pulumi.ResourceOptions(depends_on=[apis])

network = Network(
    name,
    NetworkArgs(
        regions=cloud.regions,
        cidr=cloud.network.cidr,
        serving_port=port,
        serving_cidrs=cloud.serving_port_cidrs,
        load_balancer_region=lb_region,
        labels=labels,
    ),
    after_apis,
)
identity = Identity(
    name, IdentityArgs(project=settings.project, account_id=f"{name}-hosts", stack=settings.stack), after_apis
)
if spec.secret is not None and spec.secret.secret_manager:
    HfTokenSecret(
        f"{name}-hf",
        HfTokenSecretArgs(
            project=settings.project,
            # Named as this stack creates it (gs-STACK-NAME) or as given (projects/P/secrets/NAME): read_settings.
            secret=spec.secret.secret_manager,
            accessor_member=identity.member,
            replication=cloud.secret_replication,
            token=read_hf_token(),
            labels=labels,
        ),
        after_apis,
    )
weights_bucket = None
if weights.from_bucket:
    # The bucket the spec's weights.bucket names: `gemmaserve weights mirror` fills it, hosts load from it.
    # With cloud.weights_bucket.create false another stack owns it; this one only grants its hosts.
    weights_bucket = WeightsBucket(
        f"{name}-weights",
        WeightsBucketArgs(
            project=settings.project,
            name=weights.bucket,
            location=(cloud.weights_bucket.location or settings.region).upper(),
            host_member=identity.member,
            cache_prefix=weights.compile_cache_prefix,
            writers=list(cloud.weights_bucket.writers),
            labels=labels,
            force_destroy=cloud.weights_bucket.force_destroy,
            create=cloud.weights_bucket.create,
        ),
        after_apis,
    )
if weights.source_uri:
    # A gs:// model is streamed from its own bucket, which this stack does not own: the hosts are granted read.
    grant_model_read(f"{name}-model", weights.source_uri, identity.member, after_apis)
image = ServingImage(
    name,
    ServingImageArgs(
        project=settings.project,
        location=settings.region,
        repository_id=settings.repository_id,
        reader_member=identity.member,
        build=cloud.image.build,
        base_image=spec.image,
        vllm_package=serving_plan.engine.package,
        vllm_version=spec.vllm_version,
        transformers_version=spec.transformers_version,
        chat_template_sha256=serving_plan.engine.chat_template_sha256,
        labels=labels,
    ),
    after_apis,
)

hosts = []
if settings.tpu_type is not None:
    tpu = TpuSlice(
        f"{name}-tpu",
        TpuSliceArgs(
            project=settings.project,
            zones=cloud.zones,
            accelerator_type=settings.tpu_type.accelerator_type,
            runtime_version=settings.tpu_type.runtime_version,
            provisioning=cloud.provisioning,
            fallback_provisioning=cloud.fallback_provisioning,
            flex_start_zones=settings.flex_start_zones,
            reservation=cloud.reservation,
            max_run_seconds=cloud.max_run_seconds,
            valid_until_seconds=cloud.valid_until_seconds,
            valid_after=cloud.valid_after.isoformat() if cloud.valid_after else None,
            network=network.vpc.id,
            subnetworks={r: s.id for r, s in network.subnets.items()},
            service_account=identity.email,
            enable_external_ips=cloud.allow_external_ip,
            data_disk=settings.tpu_data_disk,
            labels=labels,
            tags=[HOST_TAG],
            create_wait_seconds=cloud.create_wait_seconds,
            recycle_before_seconds=cloud.recycle_before_seconds,
            protect=cloud.protect,
        ),
        after_apis,
    )
    hosts.append(
        host_record(
            tpu.node_name,
            tpu.internal_ip,
            tpu.external_ip,
            tpu.zone,
            cloud.ssh_user,
            "tpu-vm",
            settings.tpu_type.accelerator_type,
            serving_plan,
            tpu.provisioning,
        )
    )
else:
    machine = settings.machine_type
    vms = []
    for index in range(cloud.hosts):
        zone = cloud.zones[index % len(cloud.zones)]
        vm = GpuVm(
            f"{name}-gpu-{index}",
            GpuVmArgs(
                zone=zone,
                machine_type=machine.name,
                subnetwork=network.subnets[settings.region].id,
                service_account=identity.email,
                boot_image=cloud.boot_image,
                boot_disk_type=cloud.boot_disk_type,
                boot_disk_gb=cloud.boot_disk_gb,
                weights_disk_type=cloud.weights_disk.type,
                weights_disk_gb=cloud.weights_disk.size_gb,
                local_ssd_count=cloud.weights_disk.local_ssd_count,
                provisioning=cloud.provisioning,
                max_run_seconds=cloud.max_run_seconds,
                termination_action=cloud.termination_action,
                reservation=cloud.reservation,
                allow_external_ip=cloud.allow_external_ip,
                labels=labels,
                tags=[HOST_TAG],
                create_timeout=FLEX_START_VM_CREATE_TIMEOUT if cloud.provisioning == "flex-start" else None,
            ),
            after_apis,
        )
        vms.append(vm)
        hosts.append(
            host_record(
                vm.instance.name,
                vm.internal_ip,
                vm.external_ip,
                zone,
                cloud.ssh_user,
                "gce-vm",
                machine.name,
                serving_plan,
                cloud.provisioning,
            )
        )

access = EndpointAccess(
    f"{name}-access",
    EndpointAccessArgs(
        project=settings.project,
        stack=settings.stack,
        key_secret=spec.serving.api_keys.secret_manager,
        tls_secret=spec.serving.tls.secret_manager,
        accessor_member=identity.member,
        # A TPU request still queued (create returns after a bounded wait) has no address yet: its
        # certificate gets one when `capacity wait` / the next `up` finds the slice ACTIVE.
        host_addresses=pulumi.Output.all(*hosts).apply(
            lambda records: [r["internal_ip"] for r in records if r["internal_ip"]]
        ),
        replication=cloud.secret_replication,
        labels=labels,
    ),
    after_apis,
)

if lb_region:
    by_zone: dict[str, list] = {}
    for index, vm in enumerate(vms):
        by_zone.setdefault(cloud.zones[index % len(cloud.zones)], []).append(vm.instance.self_link)
    balancer = ServingLoadBalancer(
        f"{name}-lb",
        ServingLoadBalancerArgs(
            region=settings.region,
            network=network.vpc.id,
            subnetwork=network.subnets[settings.region].id,
            instances_by_zone=by_zone,
            port=port,
            timeout_seconds=spec.serving.stream_timeout,
            ca_cert_pem=access.ca_cert_pem,
            ca_private_key_pem=access.ca_key.private_key_pem,
            depends_on=[network.proxy_subnet],
            labels=labels,
        ),
        after_apis,
    )
    endpoint = pulumi.Output.concat("https://", balancer.address, f":{port}/v1")
else:
    # None while the only host has no address yet (a TPU request still queued).
    endpoint = hosts[0].apply(lambda host: f"https://{host['internal_ip']}:{port}/v1" if host["internal_ip"] else None)

pulumi.export("hosts", pulumi.Output.all(*hosts))
pulumi.export("endpoint", endpoint)
# The CA clients trust for the endpoint (public); keys come from `gemmaserve keys add --stack`.
pulumi.export("ca_cert", access.ca_cert_pem)
pulumi.export("api_key_secret", access.key_secret_name)
pulumi.export("plan", serving_plan.to_json())
pulumi.export("artifact_repository", image.repository_url)
if weights_bucket is not None:
    pulumi.export("weights_bucket", weights_bucket.uri)
if image.image_ref is not None:
    pulumi.export("serving_image", image.image_ref)
