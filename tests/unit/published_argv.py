"""Normalises `vllm serve` command lines so a published argv and a planned argv compare flag by flag."""

from __future__ import annotations

import json
import shlex


def _value(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        pass
    if "=" in raw and "," in raw or raw.count("=") == 1:
        # vLLM's key=value,key=value form of --limit-mm-per-prompt
        return {k: json.loads(v) for k, v in (item.split("=", 1) for item in raw.split(","))}
    return raw


def serve_flags(command: str | list[str]) -> tuple[str, dict]:
    """(model, {flag: value}) for a `vllm serve MODEL ...` or `python -m ...api_server --model M ...` line."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    while argv and "=" in argv[0] and not argv[0].startswith("-"):
        argv.pop(0)  # leading VAR=value assignments
    if argv[:2] == ["vllm", "serve"]:
        model, rest = argv[2], argv[3:]
    else:
        rest = argv[argv.index("--model") :]
        model = rest[1]
        rest = rest[2:]
    flags: dict = {}
    i = 0
    while i < len(rest):
        name = "--" + rest[i].removeprefix("--").replace("_", "-")
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            flags[name] = _value(rest[i + 1])
            i += 2
        else:
            flags[name] = True
            i += 1
    return model, flags


def env_of(command: str) -> dict[str, str]:
    env = {}
    for word in shlex.split(command):
        if "=" in word and not word.startswith("-"):
            key, value = word.split("=", 1)
            env[key] = value
        else:
            break
    return env
