"""pyinfra roles: each package exposes one @deploy that turns plan values into host state, and the
Settings model its host-data keys (`<role>_*`) validate into."""

from __future__ import annotations


def _settings() -> tuple:
    from roles import (
        access,
        base,
        caches,
        hf_token,
        monitoring,
        nvidia,
        preemption,
        replicas,
        rocm,
        router,
        tpu,
        vllm,
        weights,
    )

    roles = (base, nvidia, rocm, tpu, vllm, hf_token, weights, caches, access, router, replicas, preemption, monitoring)
    return tuple(m.Settings for m in roles)


def __getattr__(name: str):
    # Lazy: importing one role (roles.router) must not import them all.
    if name == "ROLE_SETTINGS":
        return _settings()
    raise AttributeError(name)
