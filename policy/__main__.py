"""The gemmaserve policy pack: `pulumi preview --policy-pack policy/` (rules live in rules.py)."""

from pulumi_policy import EnforcementLevel, PolicyPack
from rules import POLICIES

PolicyPack(name="gemmaserve", enforcement_level=EnforcementLevel.MANDATORY, policies=POLICIES)
