"""Check `vllm serve` argv lists with vLLM's own serve parser, before any replica is restarted with them."""

# Runs as a script under the python of the venv that serves (stdlib + vllm only), so it checks against
# exactly the vLLM that will parse the flags:
#
#   python vllm_argcheck.py [FILE]      # FILE (or stdin): a JSON list of argv lists
#   python vllm_argcheck.py -- ARGS...  # one argv as words (the replicas role passes $VLLM_ARGS
#                                       # through systemd-run, expanded exactly as the unit will)
#
# Each argv may start with "vllm serve", "serve" or directly with the model. One JSON object per argv
# is printed ({"argv": [...], "ok": bool, "error": str}); the exit status is 1 if any argv is rejected
# and 2 if the input itself is unusable.

from __future__ import annotations

import contextlib
import io
import json
import os
import sys


def _prepare_environment() -> None:
    # With HF_HUB_OFFLINE set, vLLM's EngineArgs swaps a model id for its path in the local hub cache
    # (arg_utils.get_model_path), which fails on a host that has not downloaded the model yet. The check
    # is about flags, not about what is cached, so it must not depend on that. Unset before vllm imports
    # (huggingface_hub reads it once, at import).
    os.environ.pop("HF_HUB_OFFLINE", None)
    # vLLM's logger writes to stdout by default; keep stdout for the JSON results.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def build_serve_parser():
    """The parser `vllm serve` uses: the top-level CLI parser with only the serve subcommand."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers).set_defaults(dispatch_function=serve.cmd)
    return parser, serve


def normalize_argv(argv: list[str]) -> list[str]:
    """Drop a leading `vllm` (or a path to it) and `serve`, then put `serve` back in front."""
    rest = list(argv)
    if rest and os.path.basename(rest[0]) == "vllm":
        rest = rest[1:]
    if rest and rest[0] == "serve":
        rest = rest[1:]
    return ["serve", *rest]


def check_argv(parser, serve, argv: list[str]) -> str | None:
    """Return None when vLLM accepts argv, else the error message."""
    captured = io.StringIO()
    try:
        # argparse reports errors by printing usage and calling sys.exit(2); catch that and keep the message.
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            args = parser.parse_args(normalize_argv(argv))
    except SystemExit as exit_:
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        if exit_.code == 0:
            return "argv asks for help or the version instead of serving"
        return lines[-1] if lines else f"vllm's parser exited with status {exit_.code}"
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    try:
        with contextlib.redirect_stdout(captured):
            serve.validate(args)  # validate_parsed_serve_args, as `vllm serve` runs it
            _check_parser_names(args)
            _check_config_keys(args)
    except Exception as error:  # noqa: BLE001 - any rejection is reported, not raised
        return f"{type(error).__name__}: {error}"
    return None


def _check_config_keys(args) -> None:
    # The parser keeps some JSON config flags (--speculative-config) as plain dicts; the engine builds their config
    # classes only when it starts, so an unknown key would fail a replica after its restart. Each VllmConfig field
    # whose type is a config dataclass takes only that dataclass's fields.
    import dataclasses
    import typing

    from vllm.config import VllmConfig

    for name, hint in typing.get_type_hints(VllmConfig).items():
        value = getattr(args, name, None)
        config = next((t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)), None)
        if config is None or not isinstance(value, dict):
            continue
        known = {f.name for f in dataclasses.fields(config)}
        if unknown := sorted(set(value) - known):
            flag = "--" + name.replace("_", "-")
            raise KeyError(f"{flag}: unknown key(s) {unknown}; {config.__name__} takes: {', '.join(sorted(known))}")


def _check_parser_names(args) -> None:
    # vLLM checks these names only when the API server starts (validate_api_server_args); check them
    # here so a typo fails before a restart rather than in a crash loop.
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    if getattr(args, "tool_parser_plugin", None):
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if getattr(args, "reasoning_parser_plugin", None):
        ReasoningParserManager.import_reasoning_parser(args.reasoning_parser_plugin)
    tool_parser = getattr(args, "tool_call_parser", None)
    if tool_parser and tool_parser not in ToolParserManager.list_registered():
        raise KeyError(
            f"unknown tool call parser {tool_parser!r} (known: {', '.join(ToolParserManager.list_registered())})"
        )
    reasoning_parser = getattr(args, "reasoning_parser", None)
    if reasoning_parser and reasoning_parser not in ReasoningParserManager.list_registered():
        raise KeyError(
            f"unknown reasoning parser {reasoning_parser!r} (known: {', '.join(ReasoningParserManager.list_registered())})"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "--":
            # One argv given as words, e.g. expanded by systemd from a replica's env file exactly as
            # its unit's ExecStart will expand it: `vllm_argcheck.py -- $VLLM_ARGS`.
            argvs = [argv[1:]]
        else:
            text = open(argv[0]).read() if argv and argv[0] != "-" else sys.stdin.read()
            argvs = json.loads(text)
        if (
            not isinstance(argvs, list)
            or not argvs
            or not all(isinstance(a, list) and all(isinstance(s, str) for s in a) for a in argvs)
        ):
            raise ValueError("expected a JSON list of lists of strings")
    except (OSError, ValueError) as error:
        print(json.dumps({"ok": False, "error": f"bad input: {error}"}))
        return 2
    _prepare_environment()
    parser, serve = build_serve_parser()
    failed = 0
    for candidate in argvs:
        error = check_argv(parser, serve, candidate)
        failed += error is not None
        print(json.dumps({"argv": candidate, "ok": error is None, "error": error or ""}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
