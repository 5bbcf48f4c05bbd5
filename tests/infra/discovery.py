"""Google's API discovery documents (shipped in google-api-python-client) as the judge of every REST body we send.

`Discovery("tpu", "v2alpha1").request_errors("QueuedResource", body)` walks the body against the schema
the API publishes: unknown fields, wrong JSON types, values outside an enum, malformed google-duration /
google-datetime / int64 strings, output-only fields set by a client, and fields whose description says
"Required." all come back as messages naming the path. Responses are checked the same way, except that
output-only fields are allowed there.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import googleapiclient

DOCUMENTS = Path(googleapiclient.__file__).parent / "discovery_cache" / "documents"
_DURATION = re.compile(r"^-?\d+(\.\d{1,9})?s$")
_DATETIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?(Z|[+-]\d\d:\d\d)$")
_INT64 = re.compile(r"^-?\d+$")


@cache
def document(api: str, version: str) -> dict[str, Any]:
    return json.loads((DOCUMENTS / f"{api}.{version}.json").read_text())


class Discovery:
    def __init__(self, api: str, version: str):
        self.api, self.version = api, version
        self.doc = document(api, version)
        self.schemas: dict[str, Any] = self.doc["schemas"]

    def method(self, dotted: str) -> dict[str, Any]:
        """'projects.locations.queuedResources.create' -> the method's description (path, parameters, request)."""
        node: dict[str, Any] = {"resources": self.doc["resources"]}
        *resources, name = dotted.split(".")
        for resource in resources:
            node = node["resources"][resource]
        return node["methods"][name]

    def enum(self, schema: str, field: str) -> list[str]:
        return list(self.schemas[schema]["properties"][field]["enum"])

    def request_errors(self, schema: str, body: Any, partial: bool = False) -> list[str]:
        """Errors of a request body; `partial` (a PATCH with an updateMask) waives the required fields."""
        return self._check({"$ref": schema}, body, schema, request=True, partial=partial)

    def response_errors(self, schema: str, body: Any) -> list[str]:
        return self._check({"$ref": schema}, body, schema, request=False)

    def assert_request(self, schema: str, body: Any, partial: bool = False) -> None:
        errors = self.request_errors(schema, body, partial)
        assert not errors, f"{self.api} {self.version} {schema} request body refused:\n  " + "\n  ".join(errors)

    def assert_response(self, schema: str, body: Any) -> None:
        errors = self.response_errors(schema, body)
        assert not errors, f"{self.api} {self.version} {schema} response refused:\n  " + "\n  ".join(errors)

    def _check(self, spec: dict[str, Any], value: Any, path: str, request: bool, partial: bool = False) -> list[str]:
        if "$ref" in spec:
            spec = self.schemas[spec["$ref"]]
        kind = spec.get("type")
        if kind == "any" or kind is None and "properties" not in spec:
            return []
        if kind == "object":
            if not isinstance(value, dict):
                return [f"{path}: {value!r} is not an object"]
            errors: list[str] = []
            properties = spec.get("properties")
            extra = spec.get("additionalProperties")
            if properties is not None:
                for key, item in value.items():
                    if key not in properties:
                        errors.append(f"{path}.{key}: unknown field; allowed: {', '.join(sorted(properties))}")
                    elif request and properties[key].get("readOnly"):
                        errors.append(f"{path}.{key}: output only, a client may not set it")
                    else:
                        errors += self._check(properties[key], item, f"{path}.{key}", request)
                if request and not partial:
                    for key, item in properties.items():
                        if item.get("description", "").startswith("Required.") and key not in value:
                            errors.append(f"{path}.{key}: required ({item['description'][:80]})")
            elif extra is not None:
                for key, item in value.items():
                    errors += self._check(extra, item, f"{path}[{key!r}]", request)
            elif value:
                errors.append(f"{path}: must be an empty object, got {value!r}")
            return errors
        if kind == "array":
            if not isinstance(value, list):
                return [f"{path}: {value!r} is not an array"]
            errors = []
            for index, item in enumerate(value):
                errors += self._check(spec["items"], item, f"{path}[{index}]", request)
            return errors
        if kind == "string":
            if not isinstance(value, str):
                return [f"{path}: {value!r} is not a string"]
            if "enum" in spec and value not in spec["enum"]:
                return [f"{path}: {value!r} not in enum {spec['enum']}"]
            pattern = {
                "google-duration": _DURATION,
                "google-datetime": _DATETIME,
                "int64": _INT64,
                "uint64": _INT64,
            }.get(spec.get("format", ""))
            if pattern is not None and not pattern.match(value):
                return [f"{path}: {value!r} is not a {spec['format']}"]
            return []
        if kind == "boolean":
            return [] if isinstance(value, bool) else [f"{path}: {value!r} is not a boolean"]
        if kind == "integer":
            ok = isinstance(value, int) and not isinstance(value, bool)
            return [] if ok else [f"{path}: {value!r} is not an integer"]
        if kind == "number":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            return [] if ok else [f"{path}: {value!r} is not a number"]
        return [f"{path}: schema type {kind!r} not understood by this checker"]


TPU = Discovery("tpu", "v2alpha1")
COMPUTE = Discovery("compute", "v1")


def supported_update_fields(api: Discovery, method: str) -> set[str]:
    """The fields a PATCH's updateMask may name, as the method's own description lists them (camelCase)."""
    description = api.method(method)["parameters"]["updateMask"]["description"]
    listed = re.search(r"Supported fields: \[([^\]]*)\]", description)
    assert listed, f"{method}: updateMask description lists no supported fields: {description!r}"

    def camel(field: str) -> str:
        return ".".join(re.sub(r"_([a-z])", lambda m: m[1].upper(), part) for part in field.split("."))

    return {camel(f.strip()) for f in listed[1].split(",")}
