"""Every bad value gets an error naming the field, the value and what is allowed."""

import copy

import pytest

from gemmaserve.spec import SpecError, parse_spec

GOOD = {"model": "31b", "accelerator": {"kind": "rtx-pro-6000", "count": 8}}


def with_(path: str, value, base: dict = GOOD) -> dict:
    """A copy of `base` (a valid spec) with the dotted field `path` set to `value`."""
    data = copy.deepcopy(base)
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


# (input, field named, value shown, what is allowed)
BAD = [
    (with_("model", "gemma-3-27b"), "model", "gemma-3-27b", "e2b"),
    (with_("model", 31), "model", "31", "string"),
    (with_("accelerator.kind", "a100"), "accelerator.kind", "a100", "a100-80gb"),
    (with_("accelerator.kind", "v6e"), "accelerator.kind", "v6e", "tpu-v6e"),
    (with_("accelerator.count", 0), "accelerator.count", "0", "greater than or equal to 1"),
    (with_("accelerator.count", 3), "accelerator", "3", "allowed: 1, 2, 4, 8"),
    ({"model": "e2b", "accelerator": {"kind": "tpu-v6e", "count": 2}}, "accelerator", "2", "1, 4, 8"),
    (with_("accelerator.count", "eight"), "accelerator.count", "eight", "integer"),
    ({"model": "31b"}, "accelerator", "", "missing"),
    (with_("workload.max_model_len", 300000), "workload.max_model_len", "300000", "at most 262144"),
    (
        {"model": "e4b", "accelerator": {"kind": "l4"}, "workload": {"max_model_len": 200000}},
        "workload.max_model_len",
        "200000",
        "at most 131072",
    ),
    (with_("workload.max_model_len", 100), "workload.max_model_len", "100", "greater than or equal to 256"),
    (
        with_("workload.gpu_memory_utilization", 1.5),
        "workload.gpu_memory_utilization",
        "1.5",
        "less than or equal to 0.98",
    ),
    (
        with_("workload.gpu_memory_utilization", 0.0),
        "workload.gpu_memory_utilization",
        "0.0",
        "greater than or equal to 0.1",
    ),
    (with_("workload.gpu_memory_utilisation", 0.9), "workload.gpu_memory_utilisation", "", "gpu_memory_utilization"),
    (with_("workload.max_model_length", 8192), "workload.max_model_length", "", "max_model_len"),
    (with_("workload.objective", "fast"), "workload.objective", "fast", "'throughput', 'latency' or 'balanced'"),
    (with_("workload.kv_cache_dtype", "int4"), "workload.kv_cache_dtype", "int4", "'fp8'"),
    (
        {"model": "e2b", "accelerator": {"kind": "cpu"}, "workload": {"kv_cache_dtype": "fp8"}},
        "workload.kv_cache_dtype",
        "fp8",
        "supports only 'auto'",
    ),
    (with_("workload.max_num_seqs", 0), "workload.max_num_seqs", "0", "greater than or equal to 1"),
    (
        with_("workload.max_num_batched_tokens", 10),
        "workload.max_num_batched_tokens",
        "10",
        "greater than or equal to 256",
    ),
    (
        with_("workload.speculative", {"method": "eagle"}),
        "workload.speculative.method",
        "eagle",
        "'none', 'mtp' or 'ngram'",
    ),
    (
        with_("workload.speculative", {"method": "mtp", "num_tokens": 12}),
        "workload.speculative.num_tokens",
        "12",
        "less than or equal to 8",
    ),
    (with_("workload.speculative", {"num_tokens": 2}), "workload.speculative", "2", "mtp or ngram"),
    (
        {"model": "e4b", "accelerator": {"kind": "l4"}, "workload": {"speculative": {"method": "mtp"}}},
        "workload.speculative.method",
        "mtp",
        "allowed: ngram, none (MTP models: 31b, 26b-a4b)",
    ),
    (
        {
            "model": "31b",
            "accelerator": {"kind": "h100-80gb", "count": 2},
            "workload": {"speculative": {"method": "mtp"}},
            "engine": {"vllm_version": "0.20.0"},
        },
        "engine.vllm_version",
        "0.20.0",
        ">= 0.21.0",
    ),
    (with_("workload.vision_token_budget", 300), "workload.vision_token_budget", "300", "70, 140, 280, 560 or 1120"),
    (with_("workload.block_size", 12), "workload.block_size", "12", "16"),
    (
        with_("workload.limit_mm_per_prompt", {"image": -1}),
        "workload.limit_mm_per_prompt.image",
        "-1",
        "greater than or equal to 0",
    ),
    (
        with_("workload.limit_mm_per_prompt", {"images": 2}),
        "workload.limit_mm_per_prompt.images",
        "",
        "image, audio, video",
    ),
    (with_("workload.cpu_threads_bind", "all cores"), "workload.cpu_threads_bind", "all cores", "'0-3|4-7'"),
    (
        with_("workload.extra_args", ["gpu-memory-utilization"]),
        "workload.extra_args",
        "gpu-memory-utilization",
        "--flag",
    ),
    (with_("engine.kind", "docker"), "engine.kind", "docker", "'wheel' or 'container'"),
    (with_("engine.vllm_version", "latest"), "engine.vllm_version", "latest", "exact release"),
    (with_("engine.vllm_version", ">=0.19"), "engine.vllm_version", ">=0.19", "exact release"),
    # PEP 440 would normalise these; hosts get the text as written (vllm==..., image tag v...), so they are refused.
    (with_("engine.vllm_version", "v0.32.0"), "engine.vllm_version", "v0.32.0", "exact release"),
    (with_("engine.vllm_version", "0.32"), "engine.vllm_version", "0.32", "exact release"),
    (with_("engine.vllm_version", "0.32.0+cu130"), "engine.vllm_version", "0.32.0+cu130", "exact release"),
    (with_("engine.vllm_version", "0.18.1"), "engine.vllm_version", "0.18.1", ">= 0.19.0"),
    # A release candidate comes before its release: 0.19.0rc1 is not yet the release with Gemma 4.
    (with_("engine.vllm_version", "0.19.0rc1"), "engine.vllm_version", "0.19.0rc1", ">= 0.19.0"),
    (with_("engine.transformers_version", "4.57.0"), "engine.transformers_version", "4.57.0", ">= 5.5.0"),
    # The pair a real resolver rejects (vllm 0.32.0's wheel metadata), refused before any host is touched.
    (
        with_("engine.transformers_version", "5.23.0"),
        "engine.transformers_version",
        "5.23.0",
        "vllm 0.32.0 requires transformers>=5.16.1,<5.20.0",
    ),
    # Compared as PEP 440 versions: a post-release of 5.16.0 is still below the range.
    (
        with_("engine.transformers_version", "5.16.0.post1"),
        "engine.transformers_version",
        "5.16.0.post1",
        "requires transformers>=5.16.1,<5.20.0",
    ),
    (with_("engine.image", "vllm/vllm-openai:gemma4"), "engine.image", "gemma4", "version tag"),
    (with_("engine.image", "vllm/vllm-tpu:nightly"), "engine.image", "nightly", "@sha256"),
    (with_("engine.image", "vllm/vllm-openai"), "engine.image", "vllm/vllm-openai", "pinned"),
    # A tag that names no release can move as surely as `latest`.
    (with_("engine.image", "us-docker.pkg.dev/p/r/vllm:prod"), "engine.image", "vllm:prod", "version tag"),
    (with_("engine.image", "vllm/vllm-openai@sha256:abc"), "engine.image", "sha256:abc", "@sha256:DIGEST"),
    (with_("serving.shutdown_timeout", -1), "serving.shutdown_timeout", "-1", "greater than or equal to 0"),
    (with_("serving.base_port", 80), "serving.base_port", "80", "greater than or equal to 1024"),
    (with_("serving.replicas", 0), "serving.replicas", "0", "1..16"),
    (with_("serving.replicas", "many"), "serving.replicas", "many", "auto"),
    (with_("serving.tensor_parallel_size", 3), "serving.tensor_parallel_size", "3", "1, 2, 4, 8"),
    (with_("serving.tensor_parallel_size", 16), "serving.tensor_parallel_size", "16", "at most the device count 8"),
    (with_("serving", {"tensor_parallel_size": 2, "replicas": 5}), "serving.replicas", "5", "<= 8 devices"),
    (
        {"model": "26b-a4b", "accelerator": {"kind": "tpu-v6e", "count": 4}, "serving": {"tensor_parallel_size": 2}},
        "serving.tensor_parallel_size",
        "2",
        "chip count 4",
    ),
    (with_("serving.bind_address", "localhost"), "serving.bind_address", "localhost", "IPv4"),
    (with_("serving.bind_address", "::1"), "serving.bind_address", "::1", "IPv4"),
    (with_("serving.router_port", 8003), "serving.router_port", "8003", "8000..8007"),
    (
        with_("serving.routing", "round-robin"),
        "serving.routing",
        "round-robin",
        "'prefix-affinity' or 'least-outstanding'",
    ),
    (with_("secret", {}), "secret", "", "exactly one"),
    (with_("secret", {"secret_manager": "hf-token", "file": "/etc/hf"}), "secret", "", "exactly one"),
    (with_("secret", {"file": "hf-token.txt"}), "secret.file", "hf-token.txt", "absolute path"),
    (
        with_("secret", {"secret_manager": "projects/p/secrets/hf token"}),
        "secret.secret_manager",
        "hf token",
        "projects/PROJECT/secrets/NAME",
    ),
    (with_("secret", {"gcs": "gs://bucket/token"}), "secret.gcs", "", "secret_manager, file"),
    (with_("workloads", {}), "workloads", "", "allowed fields: model, accelerator, workload"),
]


@pytest.mark.parametrize("data, field, value, allowed", BAD, ids=[f"{i:02d}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_input_names_field_value_and_allowed(data, field, value, allowed):
    with pytest.raises(SpecError) as caught:
        parse_spec(data, "test")
    message = str(caught.value)
    assert field in message
    assert value in message
    assert allowed in message


def test_at_least_thirty_bad_inputs_are_covered():
    assert len(BAD) >= 30


def test_every_problem_is_reported_at_once():
    data = with_("workload", {"gpu_memory_utilization": 2.0, "objective": "fast"})
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    assert len(caught.value.problems) == 2


def test_non_mapping_spec_is_refused():
    with pytest.raises(SpecError, match="must be a mapping"):
        parse_spec(["31b"])  # type: ignore[arg-type]


def test_good_spec_parses():
    spec = parse_spec(GOOD)
    assert spec.model == "google/gemma-4-31B-it"
    assert spec.max_model_len == 32768


@pytest.mark.parametrize(
    "image",
    [
        "vllm/vllm-openai:v0.33.0",
        "localhost/gemmaserve/vllm-cpu:0.32.0-1f2e3d4c@sha256:" + "a" * 64,
        "us-docker.pkg.dev/proj/repo/vllm-gemma4@sha256:" + "0" * 64,
        "us-central1-docker.pkg.dev/proj/gemmaserve/vllm-gemma4:vllm-0.33.0-tf-5.19.0",
    ],
)
def test_pinned_images_are_accepted(image):
    assert parse_spec(with_("engine", {"kind": "container", "image": image})).engine.image == image
