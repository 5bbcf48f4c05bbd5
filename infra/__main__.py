"""The Pulumi program: validate the stack config into a spec, plan it, and export the plan.

The network, identity, secret, TpuSlice and GpuVm components are assembled here as they land
(see the Pulumi issue); today the program validates and plans, and declares no resources.
"""

import pulumi

from config import read_spec
from gemmaserve.plan import plan

spec = read_spec()
serving_plan = plan(spec).require_ok()
pulumi.export("plan", serving_plan.to_json())
