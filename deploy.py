"""pyinfra entry point: `pyinfra INVENTORY deploy.py`. Validates host data, plans, dispatches roles."""

from pyinfra import host, inventory

from gemmaserve.plan import plan
from gemmaserve.sources import capacity_from_host_data, fleet_from_host_data, spec_from_host_data
from gemmaserve.topology import parse_topo_matrix, with_topology
from roles import ROLE_SETTINGS
from roles.access import access
from roles.base import base
from roles.caches import caches
from roles.hf_token import hf_token
from roles.monitoring import monitoring
from roles.nvidia import NvidiaTopology, nvidia
from roles.preemption import preemption
from roles.replicas import replicas
from roles.rocm import rocm
from roles.router import router
from roles.tpu import tpu
from roles.vllm import vllm
from roles.weights import weights

# Bad host data, a bad role setting or a config that cannot serve stops here, before any operation
# touches the host.
host_plan = plan(spec_from_host_data(host.data.dict(), host.name)).require_ok()
capacity_from_host_data(host.data.dict(), host.name)
# The hosts that route as one (docs/routing.md#across-hosts): this run's hosts with this host's gemmaserve_fleet,
# whether or not --limit picked them, for every host to build the same ring of them all.
fleet = fleet_from_host_data(host.name, [(other.name, other.data.dict()) for other in inventory])
for settings in ROLE_SETTINGS:
    settings.from_host(host)
if host_plan.accelerator.vendor == "nvidia" and (topology := host.get_fact(NvidiaTopology)):
    # With a driver loaded: tensor-parallel groups from `nvidia-smi topo -m`, each replica on its GPUs'
    # NUMA node. Before the first driver boot the plan's index order stands until the next deploy.
    host_plan = with_topology(host_plan, parse_topo_matrix(topology))

# First: it creates /opt/gemmaserve/lib and installs what the other roles' programs import or run there
# (hostlib, gcs_json, secret_fetch: roles/_lib/programs.INSTALLS); a role that needs them refuses to run without it.
base()
# Drivers first: they may reboot, and everything after them needs the devices.
{"nvidia": nvidia, "amd": rocm, "google": tpu}.get(host_plan.accelerator.vendor, lambda _: None)(host_plan)
vllm(host_plan)
hf_token(host_plan)
# Weights local (and the mirror checked) before anything restarts: a bad bucket or revision stops here.
weights(host_plan)
caches(host_plan)
# The key map and certificate before the router: HAProxy's config check reads both.
access(host_plan)
# The router before the replicas: a replica restart drains it in HAProxy first.
router(host_plan, fleet)
replicas(host_plan)
# Spot / flex-start / TPU hosts: drain in HAProxy on a preemption notice (needs the router's admin tool).
preemption(host_plan)
monitoring(host_plan)
