"""The monitoring role's Prometheus config and alert rules for the gpu8 plan, checked by the real promtool."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gemmaserve.plan import plan
from gemmaserve.stack import load_stack_spec
from roles.monitoring import alert_rules, prometheus_args, prometheus_config

REPO = Path(__file__).resolve().parents[2]
RULES_TEST = Path(__file__).parent / "alert_rules_test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    reason = "promtool not found (apt-get install --no-install-recommends prometheus)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def gpu8():
    return plan(load_stack_spec("gpu8", REPO)).require_ok()


@pytest.fixture
def rendered(tmp_path: Path, gpu8) -> Path:
    (tmp_path / "gemmaserve.yml").write_text(alert_rules(gpu8))
    (tmp_path / "prometheus.yml").write_text(
        prometheus_config(gpu8, host_name="gpu8", rules_glob=str(tmp_path / "gemmaserve.yml"))
    )
    shutil.copy(RULES_TEST, tmp_path / "alert_rules_test.yml")
    return tmp_path


def promtool_run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_config_scrapes_every_replica_and_haproxy(gpu8) -> None:
    config = yaml.safe_load(prometheus_config(gpu8, host_name="gpu8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    vllm_targets = {c["labels"]["replica"]: c["targets"] for c in jobs["vllm"]["static_configs"]}
    assert len(gpu8.replicas) == 4
    assert vllm_targets == {str(r.index): [f"127.0.0.1:{r.port}"] for r in gpu8.replicas}
    assert jobs["haproxy"]["static_configs"] == [{"targets": ["127.0.0.1:8404"]}]
    assert jobs["haproxy"]["metrics_path"] == "/metrics"


def test_rules_hold_the_seed_thresholds(gpu8) -> None:
    rules = {r["alert"]: r for r in yaml.safe_load(alert_rules(gpu8))["groups"][0]["rules"]}
    assert rules["VllmKvCacheNearlyFull"]["expr"] == "vllm:kv_cache_usage_perc > 0.85"
    assert (rules["VllmRequestsQueued"]["expr"], rules["VllmRequestsQueued"]["for"]) == (
        "vllm:num_requests_waiting > 0",
        "30s",
    )
    assert rules["VllmReplicaDown"]["expr"] == 'up{job="vllm"} == 0'
    assert rules["HaproxyReplicaOutOfRotation"]["expr"] == 'haproxy_backend_active_servers{proxy="vllm"} < 4'


def test_promtool_check_config(promtool: str, rendered: Path) -> None:
    result = promtool_run(promtool, "check", "config", str(rendered / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_check_rules(promtool: str, rendered: Path) -> None:
    result = promtool_run(promtool, "check", "rules", str(rendered / "gemmaserve.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout + result.stderr


def test_promtool_alert_unit_tests(promtool: str, rendered: Path) -> None:
    result = promtool_run(promtool, "test", "rules", str(rendered / "alert_rules_test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_catches_a_broken_threshold(promtool: str, rendered: Path, gpu8) -> None:
    """The checks can fail: a threshold that is not a number is rejected, one at 0.95 breaks the unit tests."""
    broken = rendered / "gemmaserve.yml"
    broken.write_text(alert_rules(gpu8, {"monitoring_kv_cache_threshold": "0.85 and"}))
    assert promtool_run(promtool, "check", "rules", str(broken)).returncode != 0
    broken.write_text(alert_rules(gpu8, {"monitoring_kv_cache_threshold": 0.95}))
    assert promtool_run(promtool, "test", "rules", str(rendered / "alert_rules_test.yml")).returncode != 0


def test_prometheus_flags() -> None:
    assert prometheus_args() == (
        'ARGS="--config.file=/etc/prometheus/prometheus.yml --web.listen-address=127.0.0.1:9090'
        ' --storage.tsdb.retention.time=15d"\n'
    )
