"""The planner's rules, one per test, each traced to its public source."""

import json

import pytest

from gemmaserve.catalog import CATALOG
from gemmaserve.plan import plan
from gemmaserve.spec import parse_spec


def planned(data, **kwargs):
    return plan(parse_spec(data), **kwargs)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_tp2_replicas_for_31b_on_pcie_host():
    result = planned({"model": "31b", "accelerator": {"kind": "rtx-pro-6000", "count": 8}})
    assert [r.tensor_parallel_size for r in result.replicas] == [2, 2, 2, 2]
    assert [r.port for r in result.replicas] == [8000, 8001, 8002, 8003]
    assert [r.devices for r in result.replicas] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_small_model_gets_one_device_per_replica_for_throughput():
    result = planned(
        {"model": "e2b", "accelerator": {"kind": "l4", "count": 8}, "workload": {"objective": "throughput"}}
    )
    assert len(result.replicas) == 8 and result.replicas[0].tensor_parallel_size == 1
    assert flag(result.replicas[0].argv, "--max-num-seqs") == "256"


def test_latency_objective_widens_tp():
    result = planned(
        {"model": "e4b", "accelerator": {"kind": "h100-80gb", "count": 8}, "workload": {"objective": "latency"}}
    )
    assert result.replicas[0].tensor_parallel_size == 4
    assert flag(result.replicas[0].argv, "--max-num-seqs") == "16"


@pytest.mark.parametrize("chips", [1, 4, 8])
def test_tp_equals_chip_count_on_tpu(chips):
    result = planned({"model": "e2b", "accelerator": {"kind": "tpu-v6e", "count": chips}})
    (replica,) = result.replicas
    assert replica.tensor_parallel_size == chips
    assert replica.devices == list(range(chips))


def test_audio_kept_on_e2b():
    result = planned({"model": "e2b", "accelerator": {"kind": "l4"}, "workload": {"limit_mm_per_prompt": {"audio": 2}}})
    assert json.loads(flag(result.replicas[0].argv, "--limit-mm-per-prompt"))["audio"] == 2
    assert result.warnings == []


def test_audio_dropped_on_31b_with_warning():
    result = planned(
        {
            "model": "31b",
            "accelerator": {"kind": "h100-80gb", "count": 2},
            "workload": {"limit_mm_per_prompt": {"image": 4, "audio": 1}},
        }
    )
    assert json.loads(flag(result.replicas[0].argv, "--limit-mm-per-prompt")) == {"image": 4, "audio": 0}
    assert any("audio=1 dropped" in w and "31B" in w for w in result.warnings)


def test_text_only_means_no_image_no_audio_and_no_video():
    """vLLM's Gemma 4 takes video through the vision tower (gemma4_mm.py get_supported_mm_limits) at vLLM's default
    of 999 a prompt: the recipe's image=0,audio=0 alone keeps that tower loaded and any video_url fetched."""
    result = planned({"model": "e2b", "accelerator": {"kind": "l4"}, "workload": {"text_only": True}})
    argv = result.replicas[0].argv
    assert json.loads(flag(argv, "--limit-mm-per-prompt")) == {"image": 0, "audio": 0, "video": 0}
    assert "--allowed-media-domains" not in argv and "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in result.replicas[0].env


def _weights(workload):
    spec = {"model": "31b", "accelerator": {"kind": "h200", "count": 1}, "workload": workload}
    return planned(spec)


def test_only_a_video_limit_of_0_beside_image_0_unloads_the_vision_tower():
    tower = CATALOG.model("31b").vision_tower_bytes / 2**30
    images = _weights({"limit_mm_per_prompt": {"image": 4}})
    no_images = _weights({"limit_mm_per_prompt": {"image": 0}})
    no_media = _weights({"limit_mm_per_prompt": {"image": 0, "video": 0}})
    text_only = _weights({"text_only": True})
    weights = [r.replicas[0].capacity.weights_gib_per_device for r in (images, no_images, no_media, text_only)]
    assert weights[0] == weights[1] == pytest.approx(weights[2] + tower, abs=0.01)
    assert weights[2] == weights[3]
    # image=0 alone: videos still come in, so media URLs stay behind the allow-list, and the plan says why.
    argv = no_images.replicas[0].argv
    assert "--allowed-media-domains" in argv and no_images.replicas[0].env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    assert any("image=0 leaves video on" in w and "video: 0" in w for w in no_images.warnings)
    assert "--allowed-media-domains" not in no_media.replicas[0].argv
    assert not any("leaves video on" in w for w in no_media.warnings + text_only.warnings)


def test_async_scheduling_on_gpus():
    argv = planned({"model": "e2b", "accelerator": {"kind": "l4"}}).replicas[0].argv
    assert "--async-scheduling" in argv


def test_async_scheduling_not_on_tpu():
    argv = planned({"model": "e2b", "accelerator": {"kind": "tpu-v6e", "count": 1}}).replicas[0].argv
    assert "--async-scheduling" not in argv


def test_async_scheduling_off_with_ngram_because_vllm_rejects_the_pair():
    result = planned({"model": "e2b", "accelerator": {"kind": "l4"}, "workload": {"speculative": {"method": "ngram"}}})
    assert "--async-scheduling" not in result.replicas[0].argv
    assert any("ngram" in w for w in result.warnings)


def test_gemma4_parsers_and_tool_template():
    argv = planned({"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 2}}).replicas[0].argv
    assert flag(argv, "--reasoning-parser") == "gemma4"
    assert flag(argv, "--tool-call-parser") == "gemma4"
    assert "--enable-auto-tool-choice" in argv
    assert flag(argv, "--chat-template").endswith("tool_chat_template_gemma4.jinja")


def test_mtp_uses_assistant_checkpoint():
    argv = (
        planned(
            {
                "model": "31b",
                "accelerator": {"kind": "h100-80gb", "count": 2},
                "workload": {"speculative": {"method": "mtp", "num_tokens": 2}},
            }
        )
        .replicas[0]
        .argv
    )
    assert json.loads(flag(argv, "--speculative-config")) == {
        "method": "mtp",
        "model": "google/gemma-4-31B-it-assistant",
        "num_speculative_tokens": 2,
    }


def test_26b_a4b_mtp_uses_its_assistant_and_counts_its_weights():
    """vLLM's recipe for the MoE model (vllm-project/recipes#440): the 26B-A4B assistant, 4 tokens; its
    839,427,840 bytes load on the GPU beside the target and come out of the KV cache."""
    spec = {"model": "26b-a4b", "accelerator": {"kind": "h100-80gb", "count": 1}}
    mtp = planned({**spec, "workload": {"speculative": {"method": "mtp"}}}).require_ok().replicas[0]
    plain = planned(spec).require_ok().replicas[0]
    assert json.loads(flag(mtp.argv, "--speculative-config")) == {
        "method": "mtp",
        "model": "google/gemma-4-26B-A4B-it-assistant",
        "num_speculative_tokens": 4,
    }
    assistant_gib = 839_427_840 / 2**30
    assert mtp.capacity.weights_gib_per_device - plain.capacity.weights_gib_per_device == pytest.approx(
        assistant_gib, abs=0.01
    )
    assert plain.capacity.available_kv_cache_gib - mtp.capacity.available_kv_cache_gib == pytest.approx(
        assistant_gib, abs=1e-6
    )


def test_ngram_speculative_config():
    argv = (
        planned({"model": "e2b", "accelerator": {"kind": "l4"}, "workload": {"speculative": {"method": "ngram"}}})
        .replicas[0]
        .argv
    )
    assert json.loads(flag(argv, "--speculative-config")) == {"method": "ngram", "num_speculative_tokens": 3}


def test_fp8_kv_cache_flag_and_capacity():
    base = {"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 2}}
    auto = planned(base).replicas[0]
    fp8 = planned({**base, "workload": {"kv_cache_dtype": "fp8"}}).replicas[0]
    assert flag(fp8.argv, "--kv-cache-dtype") == "fp8"
    assert fp8.capacity.kv_cache_tokens > 1.9 * auto.capacity.kv_cache_tokens


def test_tpu_env():
    env = planned({"model": "e2b", "accelerator": {"kind": "tpu-v6e", "count": 4}}).replicas[0].env
    assert env["VLLM_TPU_BUCKET_PADDING_GAP"] == "512"
    assert env["VLLM_XLA_CACHE_PATH"].startswith("/dev/shm/")
    assert "HF_HOME" in env
    assert "VLLM_CACHE_ROOT" not in env


@pytest.mark.parametrize("kind", ["h100-80gb", "mi300x", "cpu"])
def test_gpu_and_cpu_compile_caches_on_shm(kind):
    env = planned({"model": "e2b", "accelerator": {"kind": kind}}).replicas[0].env
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[key].startswith("/dev/shm/")


def test_cuda_visible_devices_per_replica():
    result = planned(
        {"model": "e4b", "accelerator": {"kind": "h100-80gb", "count": 4}, "serving": {"tensor_parallel_size": 2}}
    )
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in result.replicas] == ["0,1", "2,3"]


def test_hip_visible_devices_on_amd():
    result = planned(
        {"model": "31b", "accelerator": {"kind": "mi300x", "count": 8}, "serving": {"tensor_parallel_size": 1}}
    )
    assert [r.env["HIP_VISIBLE_DEVICES"] for r in result.replicas] == [str(i) for i in range(8)]
    assert "CUDA_VISIBLE_DEVICES" not in result.replicas[0].env


def test_binds_ipv4():
    argv = planned({"model": "e2b", "accelerator": {"kind": "l4"}}).replicas[0].argv
    assert flag(argv, "--host") == "127.0.0.1"


def test_cpu_profile_sizes_kv_from_env_not_utilization():
    result = planned({"model": "tiny", "accelerator": {"kind": "cpu", "count": 2}, "workload": {"cpu_kv_cache_gib": 2}})
    replica = result.replicas[0]
    assert "--gpu-memory-utilization" not in replica.argv
    assert replica.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert len(result.replicas) == 2
    assert flag(replica.argv, "--served-model-name") == "gemmaserve/tiny-gemma4-test"
    assert any("TEST model" in w for w in result.warnings)


@pytest.mark.parametrize("eager, disabled", [(True, "1"), (False, None)])
def test_eager_cpu_replicas_run_torch_compile_d_helpers_as_plain_torch(eager, disabled):
    """An eager CPU replica has no C++ compiler (the vllm role installs g++ only for compiled CPU plans), and vLLM's
    sampler still torch.compiles its logprob rank count: dynamo is off there, so a logprobs request runs."""
    spec = {"model": "tiny", "accelerator": {"kind": "cpu"}, "workload": {"enforce_eager": eager}}
    assert planned(spec).replicas[0].env.get("TORCH_COMPILE_DISABLE") == disabled
    gpu = {"model": "e2b", "accelerator": {"kind": "l4"}, "workload": {"enforce_eager": True}}
    assert "TORCH_COMPILE_DISABLE" not in planned(gpu).replicas[0].env


@pytest.mark.parametrize("eager, aot", [(False, "0"), (True, None)])
def test_cpu_compile_turns_off_vllms_aot_artifacts(eager, aot):
    """vLLM 0.32 on CPU cannot reload its AOT artifacts; compiled CPU replicas use inductor's cache."""
    spec = {"model": "tiny", "accelerator": {"kind": "cpu"}, "workload": {"enforce_eager": eager}}
    assert planned(spec).replicas[0].env.get("VLLM_USE_AOT_COMPILE") == aot
    gpu = planned({"model": "e2b", "accelerator": {"kind": "l4"}}).replicas[0].env
    assert "VLLM_USE_AOT_COMPILE" not in gpu


def test_cpu_thread_binding_reaches_the_environment_and_auto_on_many_replicas_warns():
    auto = planned({"model": "tiny", "accelerator": {"kind": "cpu", "count": 2}})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in auto.replicas[0].env
    assert any("cpu_threads_bind=auto" in w for w in auto.warnings)
    pinned = planned(
        {"model": "tiny", "accelerator": {"kind": "cpu", "count": 2}, "workload": {"cpu_threads_bind": "nobind"}}
    )
    assert [r.env["VLLM_CPU_OMP_THREADS_BIND"] for r in pinned.replicas] == ["nobind", "nobind"]
    assert not any("cpu_threads_bind" in w for w in pinned.warnings)
    single = planned({"model": "tiny", "accelerator": {"kind": "cpu"}})
    assert not any("cpu_threads_bind" in w for w in single.warnings)


def test_vision_budget_above_default_resizes_tower():
    argv = (
        planned(
            {
                "model": "31b",
                "accelerator": {"kind": "h100-80gb", "count": 2},
                "workload": {"vision_token_budget": 1120},
            }
        )
        .replicas[0]
        .argv
    )
    assert json.loads(flag(argv, "--mm-processor-kwargs")) == {"max_soft_tokens": 1120}
    assert json.loads(flag(argv, "--hf-overrides"))["vision_config"]["default_output_length"] == 1120


def test_cache_key_changes_with_graph_flags():
    # 8K context, so that TP1 fits an H100 too (at 32K vLLM 0.33's in-flight sliding reserve does not)
    base = {"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 2}, "workload": {"max_model_len": 8192}}
    keys = {
        planned(base).replicas[0].cache_key,
        planned({**base, "workload": {"max_model_len": 8192, "max_num_batched_tokens": 4096}}).replicas[0].cache_key,
        planned({**base, "engine": {"vllm_version": "0.31.0"}}).replicas[0].cache_key,
        planned({**base, "serving": {"tensor_parallel_size": 1}}).replicas[0].cache_key,
    }
    assert len(keys) == 4


def test_cache_key_ignores_port_and_bind():
    base = {"model": "31b", "accelerator": {"kind": "h100-80gb", "count": 2}}
    moved = {**base, "serving": {"base_port": 9000, "bind_address": "0.0.0.0"}}
    assert planned(base).replicas[0].cache_key == planned(moved).replicas[0].cache_key


def test_refuses_when_one_request_does_not_fit_with_concrete_fixes():
    result = planned(
        {
            "model": "31b",
            "accelerator": {"kind": "rtx-pro-6000", "count": 1},
            "workload": {"max_model_len": 262144},
            "serving": {"tensor_parallel_size": 1},
        }
    )
    assert not result.ok and result.replicas == []
    (reason,) = result.refusals
    assert "262144" in reason
    assert "lower --max-model-len to" in reason
    assert "fp8" in reason


def test_refusal_suggests_more_tp_when_weights_do_not_fit():
    result = planned({"model": "31b", "accelerator": {"kind": "l4", "count": 1}})
    assert not result.ok
    assert "more tensor parallelism" in result.refusals[0]


def test_suggested_max_model_len_really_fits():
    data = {"model": "31b", "accelerator": {"kind": "rtx-pro-6000", "count": 1}, "workload": {"max_model_len": 262144}}
    reason = planned(data).refusals[0]
    suggested = int(reason.split("lower --max-model-len to ")[1].split(" ")[0])
    fixed = planned({**data, "workload": {"max_model_len": suggested}})
    assert fixed.ok and fixed.replicas[0].capacity.max_concurrency >= 1


def test_require_ok_raises_refusal():
    from gemmaserve.plan import PlanRefused

    with pytest.raises(PlanRefused):
        planned({"model": "31b", "accelerator": {"kind": "l4"}}).require_ok()


REAL_MODELS = [m for m in CATALOG.models if not m.is_test_model]
PAIRS = [(m.aliases[0], a.name, c) for m in REAL_MODELS for a in CATALOG.accelerators for c in a.valid_counts]


@pytest.mark.parametrize("model, kind, count", PAIRS)
def test_every_pair_plans_or_refuses_with_a_reason(model, kind, count):
    result = planned({"model": model, "accelerator": {"kind": kind, "count": count}})
    if result.ok:
        assert result.replicas and all(r.capacity.max_concurrency >= 1 for r in result.replicas)
    else:
        assert "Fixes:" in result.refusals[0]


@pytest.mark.parametrize(
    "model, kind, count, fits",
    [
        ("e2b", "l4", 1, True),
        ("31b", "l4", 1, False),
        ("31b", "a100-80gb", 1, True),  # vLLM's Gemma 4 recipe: 1x 80 GB minimum
        ("26b-a4b", "a100-80gb", 1, True),  # the A100 log
        ("31b", "tpu-v6e", 1, False),  # vLLM's Gemma 4 recipe: 4x Trillium minimum
        ("31b", "tpu-v6e", 4, True),
        ("26b-a4b", "tpu-v6e", 4, True),  # the Turbo-Stable write-up
        ("31b", "mi300x", 1, True),  # vLLM's Gemma 4 recipe: 1x MI300X for every model
    ],
)
def test_minimum_hardware_matches_the_vllm_recipe(model, kind, count, fits):
    assert planned({"model": model, "accelerator": {"kind": kind, "count": count}}).ok is fits


def test_headroom_rule_widens_tp_when_weights_take_over_half_a_device():
    # E4B's 14.9 GiB on a 22 GiB L4 leaves ~3.6 GiB of KV at TP1: Callstack's "safer memory headroom" -> TP2.
    result = planned({"model": "e4b", "accelerator": {"kind": "l4", "count": 8}})
    assert result.replicas[0].tensor_parallel_size == 2


def test_routing_defaults_to_prefix_affinity_with_admission_at_max_num_seqs():
    """The load bound is HAProxy's hash-balance-factor (125: no replica past 1.25x the mean); each replica
    admits as many requests as vLLM runs at once (max_num_seqs as the engine resolves it), so a queue forms
    at the balancer, not inside vLLM."""
    result = planned({"model": "31b", "accelerator": {"kind": "rtx-pro-6000", "count": 8}})
    routing = result.routing
    assert (routing.policy, routing.load_bound_percent, routing.queue_seconds) == ("prefix-affinity", 125, 5)
    assert routing.load_bound_percent <= 130
    # vLLM defaults max_num_seqs to 1024 on a >= 70 GiB GPU that is not an A100 (EngineArgs.get_batch_defaults).
    assert routing.replica_max_requests == result.replicas[0].capacity.max_num_seqs == 1024
    # Below 1/8 of that, and never past vllm-router's 64, a conversation keeps its replica whatever the mean
    # (docs/routing.md#the-load-bound).
    assert routing.affinity_floor == 64
    assert result.to_json()["routing"] == {
        "policy": "prefix-affinity",
        "load_bound": 1.25,
        "affinity_floor": 64,
        "replica_max_requests": 1024,
        "queue_seconds": 5,
        "session_header": "X-Session-Id",
    }


def test_admission_follows_the_users_max_num_seqs():
    result = planned({"model": "e2b", "accelerator": {"kind": "l4"}, "workload": {"max_num_seqs": 24}})
    assert result.routing.replica_max_requests == 24


def test_least_outstanding_has_no_bound_or_admission():
    result = planned({"model": "e2b", "accelerator": {"kind": "l4"}, "serving": {"routing": "least-outstanding"}})
    assert result.routing.to_json() == {
        "policy": "least-outstanding",
        "load_bound": None,
        "affinity_floor": None,
        "replica_max_requests": None,
        "queue_seconds": None,
        "session_header": None,
    }
    assert "leastconn" in result.routing.describe()
