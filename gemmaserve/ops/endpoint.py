"""Checks against a served OpenAI-compatible endpoint: models, chat, structured output, tools, metrics.

Plain urllib with proxies disabled: endpoints are on hosts we manage (sandbox veths or the fleet's
private network), never reached through a corporate proxy.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# The structured-output check: every string is pattern- or enum-bound because a random test model
# would otherwise emit raw control characters that strict JSON rejects (xgrammar allows them).
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
    },
    "required": ["city", "unit", "temperature"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class EndpointError(Exception):
    pass


def request(url: str, payload: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with _OPENER.open(req, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as error:
        raise EndpointError(f"{url}: {error}") from error


def get_json(url: str, payload: dict | None = None, timeout: float = 120) -> dict[str, Any]:
    status, body = request(url, payload, timeout)
    if status != 200:
        raise EndpointError(f"{url}: HTTP {status}: {body[:300]}")
    return json.loads(body)


def root_of(base_url: str) -> str:
    """http://h:8080/v1 -> http://h:8080"""
    return base_url.rstrip("/").removesuffix("/v1")


def schema_problems(document: Any, schema: dict[str, Any] = CITY_SCHEMA) -> list[str]:
    """Violations of `schema` in `document` (empty when valid)."""
    from jsonschema import Draft202012Validator

    return [error.message for error in Draft202012Validator(schema).iter_errors(document)]


@dataclass
class EndpointReport:
    models: list[str]
    chat_text: str
    structured: dict[str, Any]
    tools_finish_reason: str
    metrics_found: list[str]


def check_endpoint(base_url: str, metrics: tuple[str, ...] = ("vllm:kv_cache_usage_perc",)) -> EndpointReport:
    """Run the five user-visible checks; raise EndpointError naming the first that fails."""
    models = [m["id"] for m in get_json(f"{base_url}/models")["data"]]
    if not models:
        raise EndpointError(f"{base_url}/models lists no model")
    model = models[0]
    chat = get_json(
        f"{base_url}/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16,
            "temperature": 0,
        },
    )
    text = chat["choices"][0]["message"].get("content") or ""
    structured_reply = get_json(
        f"{base_url}/chat/completions",
        {
            "model": model,
            "max_tokens": 400,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Weather in Paris as JSON: city, unit, temperature."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city-weather", "schema": CITY_SCHEMA}},
        },
    )
    raw = structured_reply["choices"][0]["message"].get("content") or ""
    try:
        structured = json.loads(raw)
    except json.JSONDecodeError as error:
        raise EndpointError(f"json_schema output is not JSON: {raw[:200]!r} ({error})") from error
    problems = schema_problems(structured)
    if problems:
        raise EndpointError(f"json_schema output {structured} violates its schema: {'; '.join(problems)}")
    tools_reply = get_json(
        f"{base_url}/chat/completions",
        {
            "model": model,
            "max_tokens": 16,
            "temperature": 0,
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
            "messages": [{"role": "user", "content": "What is the weather in Tokyo?"}],
        },
    )
    status, body = request(f"{root_of(base_url)}/metrics")
    if status != 200:
        raise EndpointError(f"/metrics: HTTP {status}")
    missing = [m for m in metrics if m not in body]
    if missing:
        raise EndpointError(f"/metrics lacks {', '.join(missing)}")
    return EndpointReport(
        models=models,
        chat_text=text,
        structured=structured,
        tools_finish_reason=tools_reply["choices"][0]["finish_reason"],
        metrics_found=list(metrics),
    )
