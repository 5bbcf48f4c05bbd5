"""Puts policy/ on sys.path, as the Pulumi CLI does when it runs the pack, so `import rules` works."""

import sys

from tests import ROOT

POLICY = ROOT / "policy"
if str(POLICY) not in sys.path:
    sys.path.insert(0, str(POLICY))
