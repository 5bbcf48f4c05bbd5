"""vLLM 0.32.0's own serve parser judges gemmaserve's table of planned flags (gemmaserve/planned_flags.py): the option
strings of each planned destination, short and `--no-` forms included, and every vLLM option an extra argument could
abbreviate to a planned one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gemmaserve.planned_flags import OPTIONS, UNPLANNED_PREFIXES, planned_destination

pytestmark = pytest.mark.vllm

ARGCHECK_DIR = Path(__file__).parents[2] / "roles" / "vllm" / "files"

DUMP = r"""
import json, os, sys
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
sys.path.insert(0, sys.argv[1])
from vllm_argcheck import build_serve_parser
parser, _ = build_serve_parser()
serve = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices["serve"]
options = {}
for action in serve._actions:
    options.setdefault(action.dest, []).extend(action.option_strings)
defaults = vars(parser.parse_args(["serve", "m"]))
abbreviated = {}
for word, value in json.loads(sys.stdin.read()).items():
    try:
        namespace = vars(parser.parse_args(["serve", "m", word, value]))
        abbreviated[word] = [d for d, v in namespace.items() if v != defaults.get(d)]
    except SystemExit:
        abbreviated[word] = None
print(json.dumps({"options": options, "abbrev": serve.allow_abbrev, "abbreviated": abbreviated}))
"""

ABBREVIATIONS = {"--max-model": "4096", "--max-num-se": "8", "--gpu-memory": "0.5", "--served-model": "x"}
# Ambiguous in vLLM (--kv-cache-dtype, --kv-cache-dtype-skip-layers): vLLM refuses it, gemmaserve too.
AMBIGUOUS = {"--kv-cache-d": "fp8"}


@pytest.fixture(scope="module")
def vllm_parser(vllm_python: Path) -> dict:
    proc = subprocess.run(
        [str(vllm_python), "-c", DUMP, str(ARGCHECK_DIR)],
        input=json.dumps(ABBREVIATIONS | AMBIGUOUS),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_each_planned_destination_has_vllms_option_strings(vllm_parser) -> None:
    vllm = vllm_parser["options"]
    assert {dest: sorted(vllm.get(dest, [])) for dest in OPTIONS} == {
        dest: sorted(options) for dest, options in OPTIONS.items()
    }


def test_unplanned_options_that_prefix_a_planned_one_are_known(vllm_parser) -> None:
    """argparse takes an exact option before an abbreviation: a vLLM option of its own that begins a planned one is
    itself, not an abbreviation of it."""
    planned = {option for options in OPTIONS.values() for option in options if option.startswith("--")}
    unplanned = {
        option
        for dest, options in vllm_parser["options"].items()
        if dest not in OPTIONS
        for option in options
        if option.startswith("--")
    }
    assert {o for o in unplanned if any(p.startswith(o) for p in planned)} == set(UNPLANNED_PREFIXES)
    assert all(planned_destination(o) is None for o in unplanned)


def test_vllm_takes_an_abbreviation_for_the_planned_flag(vllm_parser) -> None:
    """Why abbreviations are matched: vLLM's parser allows them (allow_abbrev) and reads each as the planned flag."""
    assert vllm_parser["abbrev"] is True
    for word in ABBREVIATIONS:
        dests = vllm_parser["abbreviated"][word]
        assert dests is not None and planned_destination(word) in dests, (word, dests)
    for word in AMBIGUOUS:
        assert vllm_parser["abbreviated"][word] is None and planned_destination(word) == "kv_cache_dtype"
