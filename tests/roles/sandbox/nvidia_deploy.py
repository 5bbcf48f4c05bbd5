"""pyinfra deploy file: the nvidia role alone, for real (not --dry), on a sandbox host made to look like an
HGX H100 box (tests/roles/sandbox/test_nvidia_host.py)."""

from pyinfra import host

from gemmaserve.plan import plan
from gemmaserve.sources import spec_from_host_data
from roles.nvidia import Settings, nvidia

host_plan = plan(spec_from_host_data(host.data.dict(), host.name)).require_ok()
Settings.from_host(host)
nvidia(host_plan)
