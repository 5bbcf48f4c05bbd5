"""Published setups: spec -> argv/env equal to each setup's command as its authors published it, minus its
mistakes, plus our documented additions. The setups:

- vLLM's Gemma 4 recipe: https://docs.vllm.ai/projects/recipes/en/latest/Google/Gemma4.html
- Callstack's 31B on RTX PRO 6000: https://www.callstack.com/blog/optimizing-self-hosted-gemma-for-production-inference
- a v6e-4 write-up (E2B): https://dev.to/gde/debugging-deployments-with-gemma-2b-tpu-v6e-4-mcp-and-antigravity-cli-539h
- the v6e-4 Turbo-Stable write-up (26B-A4B): https://dev.to/gde/gemma-4-26b-on-v6e-4-turbo-stable-benchmark-7pn
- an A100 user's vLLM 0.19 log (26B-A4B, 128K): https://myoceane.fr/index.php/ai-vllm-a100-gemma-4/

Each test writes the setup's command as published, then lists exactly what differs and why.
"""

from gemmaserve.plan import CHAT_TEMPLATE_PATH, NO_MEDIA_DOMAIN, plan
from gemmaserve.spec import parse_spec

from .published_argv import env_of, serve_flags

# Our documented additions to every server: the tool chat template for tool/reasoning servers (vLLM's Gemma 4
# recipe "Server Flags Reference"; the path is where the vllm role installs it), and a graceful stop (none of
# the setups sets --shutdown-timeout, so a restart aborts their in-flight requests; serving.shutdown_timeout),
# and no media URL fetched unless workload.allowed_media_domains lists its host (each setup's vLLM fetches any).
SHUTDOWN = {"--shutdown-timeout": 120}
MEDIA = {"--allowed-media-domains": NO_MEDIA_DOMAIN}
TEMPLATE = {"--chat-template": CHAT_TEMPLATE_PATH, **SHUTDOWN, **MEDIA}

CALLSTACK_BASELINE = """CUDA_VISIBLE_DEVICES=0,1 vllm serve google/gemma-4-31B-it \
  --tensor-parallel-size 2 --gpu-memory-utilization 0.90 --max-model-len 32768 \
  --enable-auto-tool-choice --reasoning-parser gemma4 --tool-call-parser gemma4 \
  --limit-mm-per-prompt '{"image": 4, "audio": 0}' --async-scheduling --host 0.0.0.0 --port 8000"""

CALLSTACK_SPEC = {
    "model": "31b",
    "accelerator": {"kind": "rtx-pro-6000", "count": 2},
    "workload": {
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.90,
        "limit_mm_per_prompt": {"image": 4, "audio": 0},
    },
    "serving": {"bind_address": "0.0.0.0"},
}


def _only(spec_data, **kwargs):
    result = plan(parse_spec(spec_data), **kwargs)
    assert result.ok, result.refusals
    return result


def test_callstack_baseline_two_gpu_server():
    result = _only(CALLSTACK_SPEC)
    (replica,) = result.replicas
    assert serve_flags(replica.argv) == (
        serve_flags(CALLSTACK_BASELINE)[0],
        {**serve_flags(CALLSTACK_BASELINE)[1], **TEMPLATE},
    )
    assert replica.env["CUDA_VISIBLE_DEVICES"] == env_of(CALLSTACK_BASELINE)["CUDA_VISIBLE_DEVICES"]


def test_callstack_mtp_server():
    published = (
        CALLSTACK_BASELINE
        + """ --speculative-config '{"method": "mtp", "model": "google/gemma-4-31B-it-assistant", "num_speculative_tokens": 4}'"""
    )
    data = {
        **CALLSTACK_SPEC,
        "workload": {**CALLSTACK_SPEC["workload"], "speculative": {"method": "mtp", "num_tokens": 4}},
    }
    (replica,) = _only(data).replicas
    assert serve_flags(replica.argv) == (serve_flags(published)[0], {**serve_flags(published)[1], **TEMPLATE})


def test_callstack_four_tp2_replicas_on_eight_gpus():
    published_lines = [
        "CUDA_VISIBLE_DEVICES=0,1 vllm serve google/gemma-4-31B-it --tensor-parallel-size 2 --port 8000",
        "CUDA_VISIBLE_DEVICES=2,3 vllm serve google/gemma-4-31B-it --tensor-parallel-size 2 --port 8001",
        "CUDA_VISIBLE_DEVICES=4,5 vllm serve google/gemma-4-31B-it --tensor-parallel-size 2 --port 8002",
        "CUDA_VISIBLE_DEVICES=6,7 vllm serve google/gemma-4-31B-it --tensor-parallel-size 2 --port 8003",
    ]
    # No explicit TP or replica count: the planner must choose Callstack's layout itself.
    data = {**CALLSTACK_SPEC, "accelerator": {"kind": "rtx-pro-6000", "count": 8}}
    result = _only(data)
    assert len(result.replicas) == 4
    for replica, line in zip(result.replicas, published_lines, strict=True):
        model, flags = serve_flags(line)
        ours_model, ours = serve_flags(replica.argv)
        assert ours_model == model
        assert ours["--tensor-parallel-size"] == flags["--tensor-parallel-size"]
        assert ours["--port"] == flags["--port"]
        assert replica.env["CUDA_VISIBLE_DEVICES"] == env_of(line)["CUDA_VISIBLE_DEVICES"]


TURBO_STABLE_INNER = """vllm serve google/gemma-4-26B-A4B-it \
  --tensor-parallel-size 4 --dtype bfloat16 --kv-cache-dtype fp8 --gpu-memory-utilization 0.90 \
  --block-size 32 --max-model-len 16384 --max-num-seqs 256 --max-num-batched-tokens 4096 \
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' --enable-prefix-caching \
  --disable_chunked_mm_input --safetensors-load-strategy prefetch --limit-mm-per-prompt '{"image":4,"audio":1}' \
  --enable-auto-tool-choice --tool-call-parser gemma4 --reasoning-parser gemma4 --trust-remote-code"""
TURBO_STABLE_ENV = {
    "HF_HOME": "/dev/shm",
    "HF_TOKEN": "$(gcloud secrets versions access latest --secret=hf-token)",
    "VLLM_TPU_BUCKET_PADDING_GAP": "512",
    "VLLM_XLA_CACHE_PATH": "/dev/shm/vllm_cache",
}
TURBO_STABLE_SPEC = {
    "model": "26b-a4b",
    "accelerator": {"kind": "tpu-v6e", "count": 4},
    "workload": {
        "max_model_len": 16384,
        "dtype": "bfloat16",
        "kv_cache_dtype": "fp8",
        "gpu_memory_utilization": 0.90,
        "block_size": 32,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 4096,
        "speculative": {"method": "ngram", "num_tokens": 3},
        "enable_prefix_caching": True,
        "limit_mm_per_prompt": {"image": 4, "audio": 1},
        "extra_args": ["--safetensors-load-strategy", "prefetch"],
    },
    "engine": {"kind": "container", "image": "vllm/vllm-tpu:v0.32.0"},
    "secret": {"secret_manager": "hf-token"},
}


def test_turbo_stable_turbo_stable_v6e4_argv():
    result = _only(TURBO_STABLE_SPEC)
    (replica,) = result.replicas
    model, expected = serve_flags(TURBO_STABLE_INNER)
    # Mistakes in the published setup, corrected:
    # - audio=1 on 26B-A4B, which has no audio encoder: dropped with a warning;
    expected["--limit-mm-per-prompt"] = {"image": 4, "audio": 0}
    # - --trust-remote-code: Gemma 4 is native in vLLM >= 0.19, so remote code is an unneeded risk.
    del expected["--trust-remote-code"]
    # Additions: the tool template, and an explicit bind address and port (HAProxy fronts the replica).
    expected.update(TEMPLATE)
    expected.update({"--host": "127.0.0.1", "--port": 8000})
    assert serve_flags(replica.argv) == (model, expected)
    assert any("audio=1 dropped" in w for w in result.warnings)


def test_turbo_stable_turbo_stable_env():
    (replica,) = _only(TURBO_STABLE_SPEC).replicas
    assert replica.env["VLLM_TPU_BUCKET_PADDING_GAP"] == TURBO_STABLE_ENV["VLLM_TPU_BUCKET_PADDING_GAP"]
    # The XLA cache stays in /dev/shm (the 24 min -> < 10 s cold start), under a key that changes with
    # every graph-changing flag so a stale cache is never reused.
    assert replica.env["VLLM_XLA_CACHE_PATH"].startswith("/dev/shm/")
    assert replica.cache_key in replica.env["VLLM_XLA_CACHE_PATH"]
    # Mistakes corrected: the token is never an environment variable (only a tmpfs credential path),
    # and HF_HOME is on disk: 48.5 GiB of weights in /dev/shm would be lost on every preemption and
    # compete with the compile cache for RAM.
    assert "HF_TOKEN" not in replica.env
    assert replica.env["HF_TOKEN_PATH"].startswith("/run/credentials/")
    assert not replica.env["HF_HOME"].startswith("/dev/shm")


V6E4_WRITEUP_E2B = """python3 -m vllm.entrypoints.openai.api_server --model google/gemma-4-E2B-it \
  --tensor-parallel-size 4 --max-model-len 16384 --max_num_batched_tokens 4096 --disable_chunked_mm_input \
  --kv-cache-dtype fp8 --enable-auto-tool-choice --tool-call-parser gemma4 --reasoning-parser gemma4 \
  --limit-mm-per-prompt '{"image":4,"audio":1}'"""


def test_v6e4_writeup_e2b_on_v6e4():
    data = {
        "model": "e2b",
        "accelerator": {"kind": "tpu-v6e", "count": 4},
        "workload": {
            "max_model_len": 16384,
            "max_num_batched_tokens": 4096,
            "kv_cache_dtype": "fp8",
            "limit_mm_per_prompt": {"image": 4, "audio": 1},
        },
    }
    result = _only(data)
    (replica,) = result.replicas
    model, expected = serve_flags(V6E4_WRITEUP_E2B)
    # Additions: the utilization is always explicit (0.90, Callstack and the Turbo-Stable setup), plus template, host and port.
    expected.update(TEMPLATE)
    expected.update({"--gpu-memory-utilization": 0.90, "--host": "127.0.0.1", "--port": 8000, **SHUTDOWN, **MEDIA})
    assert serve_flags(replica.argv) == (model, expected)
    assert replica.tensor_parallel_size == 4  # TP = chip count
    assert result.warnings == []  # E2B has audio: nothing dropped


RECIPE_BENCHMARK = """vllm serve google/gemma-4-31B-it --tensor-parallel-size 2 --max-model-len 32768 \
  --no-enable-prefix-caching --limit-mm-per-prompt image=0,audio=0 --async-scheduling"""


def test_vllm_recipe_benchmark_server():
    data = {
        "model": "31b",
        "accelerator": {"kind": "h100-80gb", "count": 2},
        "workload": {
            "max_model_len": 32768,
            "text_only": True,
            "enable_prefix_caching": False,
            "tool_calling": False,
            "reasoning": False,
        },
    }
    (replica,) = _only(data).replicas
    model, expected = serve_flags(RECIPE_BENCHMARK)
    # Text only: no media at all, so no allow-list either. The recipe's image=0,audio=0 leaves video on (vLLM's
    # Gemma 4 takes video frames through the vision tower, 999 a prompt by default): that tower stays loaded and
    # the server fetches any video_url. The plan adds video=0.
    expected.update({"--gpu-memory-utilization": 0.90, "--host": "127.0.0.1", "--port": 8000, **SHUTDOWN})
    expected["--limit-mm-per-prompt"] |= {"video": 0}
    assert serve_flags(replica.argv) == (model, expected)


RECIPE_FULL = """vllm serve google/gemma-4-31B-it --tensor-parallel-size 2 --max-model-len 16384 \
  --gpu-memory-utilization 0.90 --enable-auto-tool-choice --reasoning-parser gemma4 --tool-call-parser gemma4 \
  --chat-template examples/tool_chat_template_gemma4.jinja --limit-mm-per-prompt image=4,audio=1 \
  --async-scheduling --host 0.0.0.0 --port 8000"""


def test_vllm_recipe_full_featured_server():
    data = {
        "model": "31b",
        "accelerator": {"kind": "h100-80gb", "count": 2},
        "workload": {"max_model_len": 16384, "limit_mm_per_prompt": {"image": 4, "audio": 1}},
        "serving": {"bind_address": "0.0.0.0"},
    }
    result = _only(data)
    (replica,) = result.replicas
    model, expected = serve_flags(RECIPE_FULL)
    # vLLM's Gemma 4 recipe asks for audio on 31B; Callstack's write-up says 31B has none. Audio is dropped, with a warning.
    expected["--limit-mm-per-prompt"] = {"image": 4, "audio": 0}
    # The template is installed by the vllm role at a fixed path, not relative to a checkout.
    expected.update(TEMPLATE)
    assert serve_flags(replica.argv) == (model, expected)
    assert any("audio=1 dropped" in w for w in result.warnings)


A100_LOG = """vllm serve google/gemma-4-26B-A4B --port 10000 --max-model-len 131072 --enforce-eager \
  --enable-chunked-prefill --enable-auto-tool-choice --reasoning-parser gemma4 --tool-call-parser gemma4 \
  --chat-template /home/vllm/examples/tool_chat_template_gemma4.jinja --gpu-memory-utilization 0.9"""


def test_a100_log_a100_server():
    data = {
        "model": "26b-a4b",
        "accelerator": {"kind": "a100-80gb", "count": 1},
        "workload": {"max_model_len": 131072, "enforce_eager": True},
        "serving": {"base_port": 10000, "router_port": 9000},
    }
    (replica,) = _only(data).replicas
    model, expected = serve_flags(A100_LOG)
    # The log's server runs the base checkpoint; we serve the instruction-tuned one our catalog names.
    assert model == "google/gemma-4-26B-A4B" and serve_flags(replica.argv)[0] == "google/gemma-4-26B-A4B-it"
    # --enable-chunked-prefill is vLLM v1's default; async scheduling is the rule vLLM's Gemma 4 recipe gives.
    del expected["--enable-chunked-prefill"]
    expected.update(TEMPLATE)
    expected.update(
        {
            "--tensor-parallel-size": 1,
            "--limit-mm-per-prompt": {"image": 4, "audio": 0},
            "--async-scheduling": True,
            "--host": "127.0.0.1",
        }
    )
    assert serve_flags(replica.argv)[1] == expected
