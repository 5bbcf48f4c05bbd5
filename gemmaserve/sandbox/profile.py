"""What sandbox hosts serve: the tiny TEST model on the `cpu` profile, as pyinfra host data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from gemmaserve.catalog import CATALOG

TINY_MODEL_DIR = Path(CATALOG.model("tiny").local_dir)
# Override the served spec with a YAML file of host-data keys (tests use it for two replicas).
OVERRIDE_ENV = "GEMMASERVE_SANDBOX_DATA"

DEFAULT_DATA: dict[str, Any] = {
    "gemmaserve_model": "tiny",
    "gemmaserve_accelerator": {"kind": "cpu", "count": 1},
    "gemmaserve_workload": {
        "max_model_len": 1024,
        "dtype": "bfloat16",
        # Eager mode starts in ~35 s instead of ~80 s on two cores; the tiny model gains nothing from compiling.
        "enforce_eager": True,
        "cpu_kv_cache_gib": 1,
        # Sandbox hosts share this machine's cores with each other: vLLM's auto binding would pin every
        # replica of every host to core 0 and leave the others idle.
        "cpu_threads_bind": "nobind",
        "limit_mm_per_prompt": {"image": 1, "video": 0},
    },
    # The test model ships its own Gemma 4-format tool template; real hosts fetch vLLM's at the pinned tag.
    "vllm_chat_template_src": str(TINY_MODEL_DIR / "chat_template.jinja"),
}


def container_engine_data(reference: str, archive: str) -> dict[str, Any]:
    """Host data that serves the same profile from the sandbox's locally built image, run by digest,
    loaded from its OCI archive (bound read-only into every host, gemmaserve/sandbox/image.py)."""
    return {"gemmaserve_engine": {"kind": "container", "image": reference}, "vllm_image_archive": archive}


def sandbox_host_data(host_data: dict[str, Any] | None = None) -> dict[str, Any]:
    """The profile, then what `sandbox` recorded for this host (the demo's engine), then the override file."""
    data = {**DEFAULT_DATA, **(host_data or {})}
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        extra = yaml.safe_load(Path(override).read_text()) or {}
        if not isinstance(extra, dict):
            raise ValueError(f"{OVERRIDE_ENV}={override}: must hold a mapping of host-data keys")
        data.update(extra)
    return data


# The sandbox's bucket (gemmaserve.sandbox.bucket) and the name the demo and tests mirror into.
SANDBOX_BUCKET = "gemmaserve-sandbox"


def bucket_host_data(revision: str, model: str = "tiny", bucket: str = SANDBOX_BUCKET) -> dict[str, Any]:
    """Host data that loads the weights from the sandbox's bucket (pulled) instead of the bound directory."""
    from gemmaserve.sandbox.bucket import ENDPOINT

    return {
        "gemmaserve_model": model,
        "gemmaserve_weights": {"source": "bucket", "bucket": f"gs://{bucket}", "revision": revision, "load": "pull"},
        "gemmaserve_storage_emulator_host": ENDPOINT,
    }
