"""Suite-wide fixtures: sandbox hosts (tests/sandbox_fixtures.py) for the tests that deploy to real hosts, and a
real GCS API emulator on loopback (tests/gcs_fixtures.py) for the bucket tests."""

pytest_plugins = ["tests.sandbox_fixtures", "tests.gcs_fixtures"]
