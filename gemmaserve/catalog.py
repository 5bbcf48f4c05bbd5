"""Facts as data: the Gemma 4 models and the accelerators that serve them, each with its source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GiB = 1024**3

Modality = Literal["text", "image", "audio", "video"]
AttentionKind = Literal["sliding", "full"]


@dataclass(frozen=True)
class AttentionShape:
    """KV heads and head size of one kind of attention layer, as vLLM allocates its KV cache."""

    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelInfo:
    """A Gemma 4 checkpoint's text architecture as vLLM sees it, plus serving facts."""

    hf_id: str
    aliases: tuple[str, ...]
    num_layers: int
    # Every `full_every`-th layer (1-based) is full attention; the rest are sliding-window.
    full_every: int
    sliding: AttentionShape
    full: AttentionShape
    sliding_window: int
    # The last `num_kv_shared_layers` layers reuse an earlier layer's KV and store none.
    num_kv_shared_layers: int
    attention_k_eq_v: bool
    max_context: int
    # Bytes of the published checkpoint (every tensor, towers included): what vLLM loads.
    checkpoint_bytes: int
    hidden_size: int
    vocab_size: int
    modalities: frozenset[str]
    total_params_b: float
    mtp_assistant: str | None = None
    mtp_assistant_bytes: int = 0
    # The vision tower (and its embedder) of `checkpoint_bytes`: vLLM builds it with transformers'
    # AutoModel (gemma4_mm.py), so every tensor-parallel rank holds all of it. It is skipped when image
    # and video are both limited to 0 (_mark_tower_model). 0 where the split is not known.
    vision_tower_bytes: int = 0
    # vision_config's hidden_size and intermediate_size: since 0.23.0 vLLM quantizes the towers with the language
    # model where both are multiples of 64 (gemma4_mm.py; VllmRelease rule towers_quantized). None: no vision tower.
    vision_tower_widths: tuple[int, int] | None = None
    num_experts: int | None = None
    experts_per_token: int | None = None
    # Query heads and MLP width (text_config num_attention_heads, intermediate_size): the shapes of the linear
    # layers vLLM wraps for LoRA. None where no public config value was found. E2B/E4B feed a per-layer input
    # embedding of hidden_size_per_layer_input through more linear layers, and E2B's KV-shared layers have a
    # double-width MLP (use_double_wide_mlp).
    num_attention_heads: int | None = None
    intermediate_size: int | None = None
    # Each routed expert's MLP width (text_config moe_intermediate_size): the shape of the expert LoRA buffers.
    moe_intermediate_size: int | None = None
    per_layer_input_size: int = 0
    double_wide_mlp: bool = False
    # A Gemma 4 Unified checkpoint (Gemma4UnifiedForConditionalGeneration: no vision or audio tower, raw patches
    # and audio frames projected into the language model). None of the catalog's models is one.
    unified: bool = False
    # Test models are built locally (`gemmaserve tiny-model`) and served from a directory.
    local_dir: str | None = None
    is_test_model: bool = False

    @property
    def layer_kinds(self) -> tuple[AttentionKind, ...]:
        return tuple("full" if (i + 1) % self.full_every == 0 else "sliding" for i in range(self.num_layers))

    @property
    def kv_layer_kinds(self) -> tuple[AttentionKind, ...]:
        """Kinds of the layers that own a KV cache (shared layers are skipped by vLLM)."""
        return self.layer_kinds[: self.num_layers - self.num_kv_shared_layers]

    @property
    def weights_gib(self) -> float:
        return self.checkpoint_bytes / GiB

    def shape(self, kind: AttentionKind) -> AttentionShape:
        return self.sliding if kind == "sliding" else self.full

    @property
    def supports_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


# Sources for the model table:
# - 31B and 26B-A4B attention shapes, windows and expert counts: the Foundation issue, matching the
#   released config.json text_config (num_hidden_layers, layer_types, num_key_value_heads, head_dim,
#   num_global_key_value_heads, global_head_dim, sliding_window, attention_k_eq_v).
# - E2B/E4B: the released config.json text_config as copied into public test fixtures (hubs are
#   unreachable here): E2B 35 layers, full attention every 5th (4:1), 1 KV head x 256 sliding and
#   1 x 512 global, window 512, 20 KV-shared layers; E4B 42 layers, every 6th full, 2 x 256 sliding,
#   2 x 512 global, window 512, 18 KV-shared layers. transformers' Gemma4TextConfig uses
#   num_global_key_value_heads only when attention_k_eq_v is true, so E2B/E4B global layers keep
#   num_key_value_heads. A v6e-4 log cross-checks E2B: "Number of Attention Layers: 15" = 35 - 20 (https://dev.to/gde/debugging-deployments-with-gemma-2b-tpu-v6e-4-mcp-and-antigravity-cli-539h).
# - vLLM allocates K *and* V for attention_k_eq_v layers (gemma4.py loads K weights into both slots),
#   so the flag does not halve the page size; an A100 user's "6.96x" (https://myoceane.fr/index.php/ai-vllm-a100-gemma-4/) only reproduces with both stored.
# - Query heads and intermediate sizes: the released text_config as public checkpoint converters assert it
#   (31B: num_attention_heads 32, intermediate_size 21504; E2B: 8 and 6144; E4B: intermediate_size 10240);
#   E2B/E4B have hidden_size_per_layer_input 256, E2B use_double_wide_mlp true. E4B's num_attention_heads 8 and
#   use_double_wide_mlp false: its config.json as a user saved it for offline loading
#   (https://github.com/zaid-muslim/AI-Voice-agent-on-Prem-/blob/f3272401ed8c24748ab2ac3c56e541a98f48ac54/models/gemma-4-E4B-it/config.json).
#   26B-A4B: num_attention_heads 16, intermediate_size 2112, moe_intermediate_size 704, in the published
#   config.json of its base model and of NVIDIA's NVFP4 quantization of the -it model, as
#   ai-dynamo/aiconfigurator vendors them (model_configs/google--gemma-4-26B-A4B_config.json at 095f58a,
#   nvidia--Gemma-4-26B-A4B-NVFP4_config.json at 90f7fc0; https://github.com/ai-dynamo/aiconfigurator).
# - Max context: model cards (128K for E2B/E4B, 256K for 31B/26B-A4B).
# - Checkpoint bytes (hubs are unreachable here; every value is quoted by public sources, none measured):
#   31B: model.safetensors.index.json metadata.total_size 62,546,177,752 (google/gemma-4-31B-it at
#     revision 842da3794eaa0b77d5f08bae87a17459d91ff475, quoted by public checkpoint tooling on GitHub);
#     = 2 bytes x 31,273,088,876 BF16 parameters, the Hub API's safetensors summary.
#   26B-A4B: metadata.total_size 51,611,872,412 (google/gemma-4-26B-A4B-it; a public write-up sums the
#     two shard headers at revision 4d7ae49 to the same bytes) = 2 x 25,805,936,206 BF16 parameters.
#     An A100 user's vLLM 0.19 log (https://myoceane.fr/index.php/ai-vllm-a100-gemma-4/) has "Model loading took 48.5 GiB" (48.07 GiB of
#     checkpoint plus buffers vLLM allocates while loading: kv_cache.gpu_profile loaded_extra counts those).
#   E2B, E4B: single-file checkpoints (model.safetensors, no index, so no metadata.total_size is
#     published). Bytes are 2 x the Hub API's BF16 parameter counts, 5,123,178,051 and 7,996,156,490:
#     10,246,356,102 and 15,992,312,980. E4B's file is quoted at 15,992,595,884 bytes (the tensors plus
#     a 282,904-byte header); E2B's tensor bytes, 10,246,356,102, are quoted as such.
# - Vision towers of 31B/26B-A4B: 27 layers, hidden 1152, intermediate 4304, a [2, 10240, 1152] position
#   table (the published vision_config), plus embed_vision's [text hidden, 1152] projection: 575,743,536
#   and 572,794,416 BF16 parameters (the latter matches the public per-tensor sum for 26B-A4B). E2B/E4B's
#   towers are not split out (no public per-tensor sums found): they count with the sharded weights. Their
#   vision_config has hidden 768 and intermediate 3072 (the published E4B config and E2B fine-tune config in
#   tests/unit/checkpoints/published), both multiples of 64, so vLLM quantizes those towers with the model.
# - Modalities: vLLM's Gemma 4 recipe ("smaller gemma4-E2B and gemma-4-E4B also support audio"), Callstack ("audio
#   support belongs to the smaller E2B and E4B models").
# - MTP assistants (vLLM builds both with gemma4_mtp.py: dense decoder layers that own no KV cache, so the
#   MoE target's KV accounting is unchanged, gemmaserve.vllm_releases gemma4_mtp_shares_kv):
#   31B: google/gemma-4-31B-it-assistant (https://www.callstack.com/blog/optimizing-self-hosted-gemma-for-production-inference);
#     its size is the Hub's "470M" parameters for the QAT release of the same assistant
#     (google/gemma-4-31B-it-qat-q4_0-unquantized-assistant, https://onlylabs.fyi/signals/bdf07c85-5eb4-4573-b293-bc19df10e294), BF16.
#   26B-A4B: google/gemma-4-26B-A4B-it-assistant (https://huggingface.co/google/gemma-4-26B-A4B-it-assistant; vLLM's
#     recipe serves it as '{"model":"google/gemma-4-26B-A4B-it-assistant","num_speculative_tokens":4}',
#     https://github.com/vllm-project/recipes/pull/440, which corrected an earlier "gemma-4-26B-it-assistant").
#     Its one model.safetensors is 839,427,840 bytes (Unsloth Studio's drafter table, unslothai/unsloth
#     studio/backend/core/inference/mlx_speculative.py, which gives the 31B assistant 939,042,560 bytes, 0.1 %
#     from the 470M above): the Hub's "0.4B" parameters in BF16, counted as the file (its header is a few KB).
MODELS: tuple[ModelInfo, ...] = (
    ModelInfo(
        hf_id="google/gemma-4-E2B-it",
        aliases=("e2b",),
        num_layers=35,
        full_every=5,
        sliding=AttentionShape(kv_heads=1, head_dim=256),
        full=AttentionShape(kv_heads=1, head_dim=512),
        sliding_window=512,
        num_kv_shared_layers=20,
        attention_k_eq_v=False,
        max_context=131072,
        checkpoint_bytes=10_246_356_102,
        hidden_size=1536,
        vocab_size=262144,
        modalities=frozenset({"text", "image", "audio", "video"}),
        total_params_b=5.1,
        num_attention_heads=8,
        intermediate_size=6144,
        per_layer_input_size=256,
        double_wide_mlp=True,
        vision_tower_widths=(768, 3072),
    ),
    ModelInfo(
        hf_id="google/gemma-4-E4B-it",
        aliases=("e4b",),
        num_layers=42,
        full_every=6,
        sliding=AttentionShape(kv_heads=2, head_dim=256),
        full=AttentionShape(kv_heads=2, head_dim=512),
        sliding_window=512,
        num_kv_shared_layers=18,
        attention_k_eq_v=False,
        max_context=131072,
        checkpoint_bytes=15_992_312_980,
        hidden_size=2560,
        vocab_size=262144,
        modalities=frozenset({"text", "image", "audio", "video"}),
        total_params_b=8.0,
        num_attention_heads=8,
        intermediate_size=10240,
        per_layer_input_size=256,
        vision_tower_widths=(768, 3072),
    ),
    ModelInfo(
        hf_id="google/gemma-4-31B-it",
        aliases=("31b",),
        num_layers=60,
        full_every=6,
        sliding=AttentionShape(kv_heads=16, head_dim=256),
        full=AttentionShape(kv_heads=4, head_dim=512),
        sliding_window=1024,
        num_kv_shared_layers=0,
        attention_k_eq_v=True,
        max_context=262144,
        checkpoint_bytes=62_546_177_752,
        hidden_size=5376,
        vocab_size=262144,
        modalities=frozenset({"text", "image", "video"}),
        total_params_b=30.7,
        num_attention_heads=32,
        intermediate_size=21504,
        mtp_assistant="google/gemma-4-31B-it-assistant",
        mtp_assistant_bytes=470_000_000 * 2,
        vision_tower_bytes=575_743_536 * 2,
        vision_tower_widths=(1152, 4304),
    ),
    ModelInfo(
        hf_id="google/gemma-4-26B-A4B-it",
        aliases=("26b-a4b", "26b"),
        num_layers=30,
        full_every=6,
        sliding=AttentionShape(kv_heads=8, head_dim=256),
        full=AttentionShape(kv_heads=2, head_dim=512),
        sliding_window=1024,
        num_kv_shared_layers=0,
        attention_k_eq_v=True,
        max_context=262144,
        checkpoint_bytes=51_611_872_412,
        hidden_size=2816,
        vocab_size=262144,
        modalities=frozenset({"text", "image", "video"}),
        total_params_b=25.2,
        num_experts=128,
        experts_per_token=8,
        num_attention_heads=16,
        intermediate_size=2112,
        moe_intermediate_size=704,
        mtp_assistant="google/gemma-4-26B-A4B-it-assistant",
        mtp_assistant_bytes=839_427_840,
        vision_tower_bytes=572_794_416 * 2,
        vision_tower_widths=(1152, 4304),
    ),
    # A randomly initialised ~300k-parameter checkpoint built by `gemmaserve tiny-model` for the
    # sandbox and tests. Its shapes are those gemmaserve.sandbox.tiny_model writes; it is not a real model.
    ModelInfo(
        hf_id="gemmaserve/tiny-gemma4-test",
        aliases=("tiny",),
        num_layers=4,
        full_every=4,
        sliding=AttentionShape(kv_heads=1, head_dim=32),
        full=AttentionShape(kv_heads=1, head_dim=64),
        sliding_window=64,
        num_kv_shared_layers=0,
        attention_k_eq_v=False,
        max_context=4096,
        checkpoint_bytes=GiB // 1000,
        hidden_size=64,
        vocab_size=573,
        modalities=frozenset({"text", "image"}),
        total_params_b=0.0003,
        local_dir="/var/lib/gemmaserve/models/tiny-gemma4",
        is_test_model=True,
    ),
    # The same network with 8 layers and a 1.0 GiB per-layer input embedding table (gemmaserve.sandbox.
    # tiny_model SIZES["1g"]): a test model big enough that loading its weights is measurable.
    ModelInfo(
        hf_id="gemmaserve/gemma4-1g-test",
        aliases=("test-1g",),
        num_layers=8,
        full_every=4,
        sliding=AttentionShape(kv_heads=1, head_dim=32),
        full=AttentionShape(kv_heads=1, head_dim=64),
        sliding_window=64,
        num_kv_shared_layers=0,
        attention_k_eq_v=False,
        max_context=4096,
        checkpoint_bytes=1_075_374_664,  # model.safetensors as built (1.0 GiB)
        hidden_size=64,
        vocab_size=573,
        modalities=frozenset({"text", "image"}),
        total_params_b=0.54,
        local_dir="/var/lib/gemmaserve/models/gemma4-1g-test",
        is_test_model=True,
    ),
)


Vendor = Literal["nvidia", "amd", "google", "cpu"]
Interconnect = Literal["nvswitch", "nvlink", "pcie", "xgmi", "ici", "none"]


@dataclass(frozen=True)
class GcpMachineType:
    """A Compute Engine machine type and the number of GPUs it carries (a2/a3/a4/g2/g4 bundle theirs)."""

    name: str
    count: int


@dataclass(frozen=True)
class TpuType:
    """A Cloud TPU accelerator type (a slice on one host) and its runtime version."""

    accelerator_type: str
    chips: int
    runtime_version: str


@dataclass(frozen=True)
class Accelerator:
    """One kind of device and how Google Cloud sells it."""

    name: str
    vendor: Vendor
    # Memory as the framework reports it (torch total_memory, or usable HBM on TPU), in GiB.
    memory_gib: float
    interconnect: Interconnect
    max_devices_per_host: int
    gcp_machine_types: tuple[GcpMachineType, ...] = ()
    tpu_types: tuple[TpuType, ...] = ()
    fp8_kv_cache: bool = True
    # vLLM's default max_num_batched_tokens / max_num_seqs for `vllm serve` on this device (v0.19
    # engine/arg_utils.py get_batch_defaults: >= 70 GiB and not an A100 gets 8192/1024, else 2048/256;
    # CPU 2048/128; TPU v6e 1024, v5e 512 tokens).
    default_max_num_batched_tokens: int = 2048
    default_max_num_seqs: int = 256
    # NVIDIA compute capability as major*10+minor (vLLM's get_min_capability scale), None elsewhere.
    compute_capability: int | None = None
    # Streaming multiprocessors (AMD: compute units): vLLM's Triton top-k/top-p sampler keeps one fp32
    # vocabulary row per SM, at most (gemmaserve.kv_cache.gpu_profile).
    multiprocessors: int = 0

    @property
    def is_tpu(self) -> bool:
        return self.vendor == "google"

    @property
    def is_gpu(self) -> bool:
        return self.vendor in ("nvidia", "amd")

    @property
    def is_cpu(self) -> bool:
        return self.vendor == "cpu"

    @property
    def visible_devices_env(self) -> str | None:
        return {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES"}.get(self.vendor)

    @property
    def valid_counts(self) -> tuple[int, ...]:
        """Device counts one host can have."""
        if self.tpu_types:
            # A larger slice spans several hosts (the cloud config says how many).
            return tuple(sorted({t.chips for t in self.tpu_types if t.chips <= self.max_devices_per_host}))
        if self.gcp_machine_types:
            counts = {m.count for m in self.gcp_machine_types if m.count <= self.max_devices_per_host}
            # Bare-metal hosts are not limited to Google's shapes.
            counts |= {1, 2, 4, 8} & set(range(1, self.max_devices_per_host + 1))
            return tuple(sorted(counts))
        return tuple(c for c in (1, 2, 4, 8) if c <= self.max_devices_per_host)

    def machine_type_for(self, count: int) -> GcpMachineType | None:
        return next((m for m in self.gcp_machine_types if m.count == count), None)

    def tpu_type_for(self, count: int) -> TpuType | None:
        return next((t for t in self.tpu_types if t.chips == count), None)


def _a2(prefix: str, counts: tuple[int, ...]) -> tuple[GcpMachineType, ...]:
    return tuple(GcpMachineType(f"{prefix}-{c}g", c) for c in counts)


# Sources for the accelerator table:
# - Memory: what torch.cuda.get_device_properties().total_memory reports (vLLM sizes against it), e.g.
#   A100 80GB 79.25 GiB, H100 80GB 79.19 GiB; TPU v6e "32 GB of physical HBM, of which 31.25 GiB is
#   usable" (the v6e-4 log); RTX PRO 6000 Blackwell Server Edition "96 GB GDDR7" (Callstack), PCIe Gen5 x16
#   links and no NVLink (Callstack's 8-GPU host table).
# - Machine types: cloud.google.com/compute/docs/gpus (a2-highgpu-{1,2,4,8}g and a2-megagpu-16g for
#   A100 40GB, a2-ultragpu-{1,2,4,8}g for A100 80GB, a3-highgpu-{1,2,4,8}g for H100, a3-ultragpu-8g
#   for H200, a4-highgpu-8g for B200, g4-standard-{48,96,192,384} for 1/2/4/8 RTX PRO 6000,
#   g2-standard-{4..32}/24/48/96 for 1/2/4/8 L4). AMD Instinct is not sold on Google Cloud: bare metal.
# - TPU types and runtimes: cloud.google.com/tpu/docs/runtimes (v2-alpha-tpuv6e for Trillium,
#   v2-alpha-tpuv5-lite for v5e, the tpu7x Ironwood runtime) and https://dev.to/gde/debugging-deployments-with-gemma-2b-tpu-v6e-4-mcp-and-antigravity-cli-539h (v6e-4, TP = chip count).
# - Compute capability: https://developer.nvidia.com/cuda-gpus (A100 8.0, L4 8.9, H100/H200 9.0, B200 10.0,
#   RTX PRO 6000 Blackwell Server Edition 12.0); it decides which quantized kernels vLLM can run.
# - Multiprocessors: NVIDIA's architecture whitepapers (A100 108 SMs, H100 SXM5 and H200 132, B200 148, L4 58,
#   RTX PRO 6000 Blackwell 188) and AMD's Instinct data sheets (MI300X/MI325X 304 CUs, MI355X 256).
ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator(
        name="a100-40gb",
        multiprocessors=108,
        vendor="nvidia",
        compute_capability=80,
        memory_gib=39.39,
        interconnect="nvswitch",
        max_devices_per_host=16,
        gcp_machine_types=_a2("a2-highgpu", (1, 2, 4, 8)) + (GcpMachineType("a2-megagpu-16g", 16),),
    ),
    Accelerator(
        name="a100-80gb",
        multiprocessors=108,
        vendor="nvidia",
        compute_capability=80,
        memory_gib=79.25,
        interconnect="nvswitch",
        max_devices_per_host=8,
        gcp_machine_types=_a2("a2-ultragpu", (1, 2, 4, 8)),
    ),
    Accelerator(
        name="h100-80gb",
        multiprocessors=132,
        vendor="nvidia",
        compute_capability=90,
        memory_gib=79.19,
        interconnect="nvswitch",
        max_devices_per_host=8,
        gcp_machine_types=_a2("a3-highgpu", (1, 2, 4, 8)) + (GcpMachineType("a3-megagpu-8g", 8),),
        default_max_num_batched_tokens=8192,
        default_max_num_seqs=1024,
    ),
    Accelerator(
        name="h200",
        multiprocessors=132,
        vendor="nvidia",
        compute_capability=90,
        memory_gib=139.81,
        interconnect="nvswitch",
        max_devices_per_host=8,
        gcp_machine_types=(GcpMachineType("a3-ultragpu-8g", 8),),
        default_max_num_batched_tokens=8192,
        default_max_num_seqs=1024,
    ),
    Accelerator(
        name="b200",
        multiprocessors=148,
        vendor="nvidia",
        compute_capability=100,
        memory_gib=178.35,
        interconnect="nvswitch",
        max_devices_per_host=8,
        gcp_machine_types=(GcpMachineType("a4-highgpu-8g", 8),),
        default_max_num_batched_tokens=8192,
        default_max_num_seqs=1024,
    ),
    Accelerator(
        name="rtx-pro-6000",
        multiprocessors=188,
        vendor="nvidia",
        compute_capability=120,
        memory_gib=94.97,
        interconnect="pcie",
        max_devices_per_host=8,
        gcp_machine_types=tuple(
            GcpMachineType(f"g4-standard-{n}", c) for n, c in ((48, 1), (96, 2), (192, 4), (384, 8))
        ),
        default_max_num_batched_tokens=8192,
        default_max_num_seqs=1024,
    ),
    Accelerator(
        name="l4",
        multiprocessors=58,
        vendor="nvidia",
        compute_capability=89,
        memory_gib=22.05,
        interconnect="pcie",
        max_devices_per_host=8,
        gcp_machine_types=tuple(GcpMachineType(f"g2-standard-{n}", c) for n, c in ((8, 1), (24, 2), (48, 4), (96, 8))),
    ),
    Accelerator(
        name="mi300x",
        multiprocessors=304,
        vendor="amd",
        memory_gib=191.98,
        interconnect="xgmi",
        max_devices_per_host=8,
        default_max_num_batched_tokens=8192,
        default_max_num_seqs=1024,
    ),
    Accelerator(
        name="mi325x",
        multiprocessors=304,
        vendor="amd",
        memory_gib=255.98,
        interconnect="xgmi",
        max_devices_per_host=8,
        default_max_num_batched_tokens=8192,
        default_max_num_seqs=1024,
    ),
    Accelerator(
        name="mi355x",
        multiprocessors=256,
        vendor="amd",
        memory_gib=287.98,
        interconnect="xgmi",
        max_devices_per_host=8,
        default_max_num_batched_tokens=8192,
        default_max_num_seqs=1024,
    ),
    Accelerator(
        name="tpu-v5e",
        vendor="google",
        memory_gib=15.75,
        interconnect="ici",
        max_devices_per_host=8,
        tpu_types=tuple(TpuType(f"v5litepod-{c}", c, "v2-alpha-tpuv5-lite") for c in (1, 4, 8)),
        default_max_num_batched_tokens=512,
    ),
    Accelerator(
        name="tpu-v6e",
        vendor="google",
        memory_gib=31.25,
        interconnect="ici",
        max_devices_per_host=8,
        tpu_types=tuple(TpuType(f"v6e-{c}", c, "v2-alpha-tpuv6e") for c in (1, 4, 8)),
        default_max_num_batched_tokens=1024,
    ),
    Accelerator(
        # Ironwood: 192 GB HBM3E per chip; usable share assumed as on v6e (31.25 of 32). "Each Ironwood
        # (TPU7x) VM contains four chips" (cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood): an
        # 8-chip slice spans two hosts. tpu7x-8 names 8 TensorCores (two a chip), one 4-chip VM, as v5p's
        # names count TensorCores (docs/google-cloud.md; Google's page does not spell it out).
        name="tpu-v7",
        vendor="google",
        memory_gib=187.5,
        interconnect="ici",
        max_devices_per_host=4,
        tpu_types=(TpuType("tpu7x-8", 4, "v2-alpha-tpu7-ubuntu2404"),),
    ),
    Accelerator(
        # The local sandbox: vLLM's CPU build. Its KV cache size is set explicitly
        # (VLLM_CPU_KVCACHE_SPACE), so `memory_gib` is the budget a replica may use, not device HBM.
        name="cpu",
        vendor="cpu",
        memory_gib=8.0,
        interconnect="none",
        max_devices_per_host=8,
        fp8_kv_cache=False,
        default_max_num_batched_tokens=2048,
        default_max_num_seqs=128,
    ),
)


@dataclass(frozen=True)
class Catalog:
    models: tuple[ModelInfo, ...] = MODELS
    accelerators: tuple[Accelerator, ...] = ACCELERATORS

    def model(self, name: str) -> ModelInfo:
        wanted = name.strip().lower()
        for m in self.models:
            if wanted == m.hf_id.lower() or wanted in m.aliases:
                return m
        raise KeyError(name)

    def accelerator(self, name: str) -> Accelerator:
        for a in self.accelerators:
            if a.name == name.strip().lower():
                return a
        raise KeyError(name)

    def model_names(self) -> list[str]:
        return [n for m in self.models for n in (m.aliases[0], m.hf_id)]

    def accelerator_names(self) -> list[str]:
        return [a.name for a in self.accelerators]


CATALOG = Catalog()
