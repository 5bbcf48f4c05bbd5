"""pyinfra entry point: `pyinfra INVENTORY deploy.py`. Validates host data, plans, dispatches roles."""

from pyinfra import host

from gemmaserve.hostdata import spec_from_host_data
from gemmaserve.plan import plan
from roles.base import base
from roles.replicas import replicas
from roles.router import router
from roles.vllm import vllm

# Bad host data or a config that cannot serve stops here, before any operation touches the host.
serving = plan(spec_from_host_data(host.data.dict(), host.name)).require_ok()

base()
vllm(serving)
replicas(serving)
router(serving)
