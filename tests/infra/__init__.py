"""Tests of the Pulumi program, its provider and its fakes: infra/ modules are imported flat, as Pulumi runs them."""

import sys
from pathlib import Path

INFRA = Path(__file__).resolve().parents[2] / "infra"
if str(INFRA) not in sys.path:
    sys.path.insert(0, str(INFRA))
