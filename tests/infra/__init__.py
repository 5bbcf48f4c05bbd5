"""Tests of the Pulumi program, its provider and its fakes: infra/ modules are imported flat, as Pulumi runs them."""

import sys

from tests import ROOT

INFRA = ROOT / "infra"
if str(INFRA) not in sys.path:
    sys.path.insert(0, str(INFRA))
