"""Suite-wide options: the verification suite runs only against a named inventory."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--inventory",
        default=None,
        help="pyinfra inventory for tests/verify (e.g. hosts/gpu8.py); without it tests/verify is not collected",
    )


def pytest_ignore_collect(collection_path, config) -> bool | None:
    # tests/verify checks deployed hosts: it needs an inventory, and `gemmaserve verify` passes one.
    if (
        "verify" in collection_path.parts
        and collection_path.name != "conftest.py"
        and not config.getoption("--inventory")
    ):
        return True
    return None
