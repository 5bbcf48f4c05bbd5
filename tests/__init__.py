"""The test suite; ROOT is the checkout it tests (the project directory: docs/, Pulumi.*.yaml, deploy.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
