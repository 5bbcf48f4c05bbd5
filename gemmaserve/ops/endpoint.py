"""Talking to a served endpoint as a client does (an API key, TLS verified against a CA the caller names),
and the checks run against it: models, chat, structured output, tools.

Every client in gemmaserve (the demo, status, verify, bench, the tests) gets its key and CA from here:
`Credentials.from_env()` reads GEMMASERVE_API_KEY and GEMMASERVE_CA_CERT. Proxies are never used:
endpoints are on hosts we manage (sandbox veths or the fleet's private network).
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

API_KEY_ENV = "GEMMASERVE_API_KEY"
CA_CERT_ENV = "GEMMASERVE_CA_CERT"
# What the OpenAI SDK sends for a key when there is none (Credentials.openai).
NO_API_KEY = "no-key"


@dataclass(frozen=True)
class Credentials:
    """An API key and the CA bundle that verifies the endpoint's certificate (None: the system's store).

    Certificates are always verified; there is no switch to turn that off.
    """

    api_key: str | None = None
    ca_cert: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Credentials:
        return cls(environ.get(API_KEY_ENV) or None, environ.get(CA_CERT_ENV) or None)

    def __repr__(self) -> str:  # never print a key
        return f"Credentials(api_key={'<set>' if self.api_key else None}, ca_cert={self.ca_cert!r})"

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_cert) if self.ca_cert else ssl.create_default_context()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, base_url: str, **options: Any):
        """The OpenAI SDK for `base_url`, with this key and this CA (and no proxy).

        Without a key the SDK still sends one (it refuses to run without): NO_API_KEY, which a gemmaserve endpoint
        refuses as it refuses none (401), and an endpoint that takes no key (vllm-router in the sandbox) ignores.
        """
        from openai import DefaultHttpxClient, OpenAI

        http_client = DefaultHttpxClient(verify=self.ssl_context(), trust_env=False)
        return OpenAI(base_url=base_url, api_key=self.api_key or NO_API_KEY, http_client=http_client, **options)

    def opener(self) -> urllib.request.OpenerDirector:
        return urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self.ssl_context())
        )


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


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI base URL (https://HOST:PORT/v1) and the credentials to call it with."""

    base_url: str
    credentials: Credentials

    @property
    def root(self) -> str:
        return root_of(self.base_url)

    def url(self, path: str) -> str:
        """A path on the balancer: "/v1/models", "/health", "/metrics"."""
        return self.root + path

    def openai(self, **options: Any):
        return self.credentials.openai(self.base_url, **options)

    def request(
        self,
        path: str,
        payload: dict | None = None,
        timeout: float = 120,
        key: str | None = "",
        method: str | None = None,
    ) -> tuple[int, str]:
        """(status, body); `key` overrides the API key ("" keeps it, None sends none)."""
        credentials = self.credentials if key == "" else Credentials(key, self.credentials.ca_cert)
        return request(self.url(path), payload, timeout, credentials, method)


def request(
    url: str,
    payload: dict | None = None,
    timeout: float = 120,
    credentials: Credentials | None = None,
    method: str | None = None,
) -> tuple[int, str]:
    """(status, body) of one request; HTTP errors are returned, connection and TLS failures raised."""
    credentials = credentials or Credentials()
    data = json.dumps(payload).encode() if payload is not None else None
    headers = {**credentials.headers(), **({"Content-Type": "application/json"} if data else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with credentials.opener().open(req, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        # HTTPException: an answer that is not HTTP at all (plain HTTP sent to a TLS port gets a TLS alert).
        raise EndpointError(f"{url}: {error!r}") from error


def get_json(
    url: str, payload: dict | None = None, timeout: float = 120, credentials: Credentials | None = None
) -> dict[str, Any]:
    status, body = request(url, payload, timeout, credentials)
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
    refused: dict[str, int]


def check_endpoint(base_url: str, credentials: Credentials) -> EndpointReport:
    """The user-visible checks: models, chat, json_schema, tools with the key; no key and a non-API route
    refused. Raise EndpointError naming the first that fails."""
    models = [m["id"] for m in get_json(f"{base_url}/models", credentials=credentials)["data"]]
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
        credentials=credentials,
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
        credentials=credentials,
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
        credentials=credentials,
    )
    # What must not work: no key, and a route that is not the API (vLLM's own /metrics).
    refused = {
        "no key": request(f"{base_url}/models", credentials=Credentials(None, credentials.ca_cert))[0],
        "/metrics": request(f"{root_of(base_url)}/metrics", credentials=credentials)[0],
    }
    if refused != {"no key": 401, "/metrics": 404}:
        raise EndpointError(f"expected 401 without a key and 404 for /metrics, got {refused}")
    return EndpointReport(
        models=models,
        chat_text=text,
        structured=structured,
        tools_finish_reason=tools_reply["choices"][0]["finish_reason"],
        refused=refused,
    )
