"""workload.allowed_media_domains: which hosts' media URLs vLLM may fetch (none by default), as vLLM's own flag."""

from __future__ import annotations

import pytest

from gemmaserve.plan import NO_MEDIA_DOMAIN, plan
from gemmaserve.spec import SpecError, parse_spec


def replica(**workload):
    spec = parse_spec({"model": "31b", "accelerator": {"kind": "h200", "count": 1}, "workload": workload})
    return plan(spec).require_ok().replicas[0]


def flag(argv: list[str]) -> list[str] | None:
    if "--allowed-media-domains" not in argv:
        return None
    start = argv.index("--allowed-media-domains") + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


def test_by_default_no_media_url_is_fetched():
    served = replica()
    assert flag(served.argv) == [NO_MEDIA_DOMAIN]
    assert NO_MEDIA_DOMAIN.endswith(".invalid")  # RFC 6761: never resolves
    assert served.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"


def test_listed_hosts_reach_vllm_in_order():
    served = replica(allowed_media_domains=["images.example.com", "cdn.example", "10.1.2.3"])
    assert flag(served.argv) == ["images.example.com", "cdn.example", "10.1.2.3"]
    # An allowed host's redirect could lead anywhere: vLLM follows none.
    assert served.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"


def test_a_text_only_server_gets_no_media_flags():
    served = replica(text_only=True)
    assert flag(served.argv) is None and "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in served.env


@pytest.mark.parametrize(
    "value",
    [
        "https://images.example.com",
        "images.example.com/path",
        "images.example.com:443",
        "*.example.com",
        "Images.Example.com",
        "images.example.com.",
        "-bad.example",
        "",
        "a b",
        "x\nextra",
        "a" * 64 + ".example",
    ],
)
def test_anything_but_a_host_name_is_refused_by_name(value):
    with pytest.raises(SpecError) as caught:
        parse_spec(
            {
                "model": "31b",
                "accelerator": {"kind": "h200", "count": 1},
                "workload": {"allowed_media_domains": [value]},
            }
        )
    message = str(caught.value)
    assert "workload.allowed_media_domains" in message and repr(value) in message and "allowed:" in message
