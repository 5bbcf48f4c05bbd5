"""The checkpoints users bring, deployed by the roles on a sandbox host and asked through its front door (TLS, the
API key, HAProxy) with the OpenAI SDK: a fine-tune of the tiny test model under its own name with a LoRA adapter
beside it, then its INT8 W8A8 quantization (compressed-tensors, which vLLM's CPU build runs). The variants are built
next to the tiny model (gemmaserve.sandbox.tiny_variants), in the models directory every host binds read-only.

tests/vllm/test_served_variants.py serves the same checkpoints from the plan's argv without a host; this is the
path a user takes: host data naming a directory and adapters, `pyinfra ... deploy.py`, a client.
"""

from __future__ import annotations

import pytest

from gemmaserve.plan import plan
from gemmaserve.sandbox.profile import TINY_MODEL_DIR, sandbox_host_data
from gemmaserve.sandbox.tiny_model import build_tiny_model
from gemmaserve.sandbox.tiny_variants import ensure_variant
from gemmaserve.sources import spec_from_host_data
from tests.sandbox_fixtures import deploy, sandbox_endpoint, wait_until

pytestmark = pytest.mark.sandbox

FINE_TUNE, ADAPTER, W8A8 = "tiny-gemma4-ft", "tiny-gemma4-lora", "tiny-gemma4-w8a8"
# vLLM's CPU build logs the kernel it picks for compressed-tensors' W8A8 INT8 (kernels/linear/__init__.py at v0.32.0).
W8A8_KERNEL = "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8"
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def variants(sandbox_hosts) -> dict[str, str]:
    if not (TINY_MODEL_DIR / "gemmaserve_test_model.json").is_file():
        build_tiny_model(TINY_MODEL_DIR)
    built = {}
    for variant, name in (("fine-tune", FINE_TUNE), ("lora", ADAPTER), ("w8a8", W8A8)):
        path, _ = ensure_variant(variant, TINY_MODEL_DIR, TINY_MODEL_DIR.parent / name, log=lambda line: print(line))
        built[name] = str(path)
    return built


@pytest.fixture(scope="module")
def host(sandbox_hosts, tmp_path_factory):
    """sandbox-1, deployed back to the profile's own model afterwards for the modules after this one."""
    host = sandbox_hosts[0]
    yield host
    result = deploy(host.name, {}, tmp_path_factory.mktemp("checkpoints-restore"))
    assert result.returncode == 0, result.output[-3000:]


def deployed(host, data: dict, tmp_path):
    """Deploy `data` over the profile; its plan, and the host's endpoint once HAProxy has the replica UP."""
    result = deploy(host.name, data, tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    print(f"\n[figure] deploy of {data['gemmaserve_model']}: {result.seconds:.1f} s")
    host_plan = plan(spec_from_host_data(sandbox_host_data(data))).require_ok()
    endpoint = sandbox_endpoint(host)
    client = endpoint.openai(max_retries=0, timeout=120)

    def serving() -> bool:
        try:
            return host_plan.model.hf_id in {m.id for m in client.models.list().data}
        except Exception:  # not up yet: the replica restarts with the new checkpoint
            return False

    wait_until(serving, 300, f"{host_plan.model.hf_id} to be served")
    return host_plan, client


def test_a_fine_tune_and_its_adapter_are_served_under_their_own_names(host, variants, tmp_path, sandbox_host):
    data = {
        "gemmaserve_model": variants[FINE_TUNE],
        "gemmaserve_serving": {"lora_adapters": [{"name": ADAPTER, "source": variants[ADAPTER]}]},
    }
    host_plan, client = deployed(host, data, tmp_path)
    assert host_plan.model.hf_id == FINE_TUNE and [a.name for a in host_plan.adapters] == [ADAPTER]
    env = sandbox_host.file("/etc/gemmaserve/replica-0.env").content_string
    assert f"{ADAPTER}={variants[ADAPTER]}" in env
    assert {m.id for m in client.models.list().data} == {FINE_TUNE, ADAPTER}
    journal = sandbox_host.run("journalctl -u vllm@0 --no-pager -o cat").stdout
    assert f"Loaded new LoRA adapter: name '{ADAPTER}', path '{variants[ADAPTER]}'" in journal
    # Logprobs too: vLLM's sampler torch.compiles their rank count, and the host has no C++ compiler (the plan turns
    # dynamo off for eager CPU replicas; before that this request crashed the engine core).
    tokens = {}
    for model in (FINE_TUNE, ADAPTER):
        answer = client.chat.completions.create(
            model=model, messages=PROMPT, max_tokens=8, temperature=0, logprobs=True
        )
        assert answer.model == model and answer.usage.completion_tokens > 0
        tokens[model] = [(t.token, round(t.logprob, 4)) for t in answer.choices[0].logprobs.content]
    # The adapter changes what the model computes: the same greedy request gives other tokens or other logprobs.
    assert tokens[FINE_TUNE] != tokens[ADAPTER]


def test_a_w8a8_checkpoint_is_served_quantized(host, variants, tmp_path, sandbox_host):
    host_plan, client = deployed(host, {"gemmaserve_model": variants[W8A8]}, tmp_path)
    assert host_plan.quantization is not None and host_plan.quantization.method == "compressed-tensors"
    journal = sandbox_host.run("journalctl -u vllm@0 --no-pager -o cat").stdout
    assert W8A8_KERNEL in journal
    answer = client.chat.completions.create(model=W8A8, messages=PROMPT, max_tokens=8, temperature=0)
    assert answer.model == W8A8 and answer.usage.completion_tokens > 0
