"""Print the route table of the installed vLLM's OpenAI server for one `vllm serve` argv, as JSON.

Runs on a sandbox host under the serving venv's python (copied there by tests/roles/sandbox/test_access.py):

    python vllm_routes.py -- ARGV...   ->   [{"path": "/v1/models", "methods": ["GET"], "kind": "APIRoute"}, ...]

The app is built the way `vllm serve` builds it (vllm.entrypoints.launchers.app.build_app, after vLLM's own
parser, through the vllm role's argcheck program), without an engine: every router it registers is listed,
including routes the OpenAPI document leaves out (the /metrics mount, the docs).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, "/opt/gemmaserve/lib")


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import vllm_argcheck

    parser, _ = vllm_argcheck.build_serve_parser()
    args = parser.parse_args(vllm_argcheck.normalize_argv(argv))
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    from vllm.entrypoints.launchers.app import build_app

    app = build_app(args, ("generate",))
    routes = [
        {"path": route.path, "methods": sorted(getattr(route, "methods", None) or []), "kind": type(route).__name__}
        for route in app.routes
    ]
    print(json.dumps(routes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:] if sys.argv[1:2] == ["--"] else sys.argv[1:]))
