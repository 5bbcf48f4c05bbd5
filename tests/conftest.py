"""Suite-wide fixtures: sandbox hosts (tests/sandbox_fixtures.py) for the tests that deploy to real hosts."""

pytest_plugins = ["tests.sandbox_fixtures"]
