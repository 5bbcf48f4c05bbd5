"""pyinfra deploy file: the base and rocm roles, for real (not --dry), on a sandbox host made to look like an
MI300X box (tests/roles/sandbox/test_rocm_host.py)."""

from pyinfra import host

from gemmaserve.plan import plan
from gemmaserve.sources import spec_from_host_data
from roles.base import Settings as BaseSettings
from roles.base import base
from roles.rocm import Settings, rocm

host_plan = plan(spec_from_host_data(host.data.dict(), host.name)).require_ok()
BaseSettings.from_host(host)
Settings.from_host(host)
base()
rocm(host_plan)
