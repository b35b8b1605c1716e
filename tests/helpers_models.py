"""Shared model fixtures: tiny random-weight HF checkpoints (no network), tiny GGUF
files written the way llama.cpp's converter writes them, and the default model.

Import as ``from tests.helpers_models import write_tiny_hf_model``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5-Instruct's chat template (tools in the system turn, <tool_call> / <tool_response>):
# a real template that renders OpenAI tool calls and tool results.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

TINY_VOCAB_SIZE = 512

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks.\n",
    "A radix tree shares prefixes between requests; 1234567890 tokens.\n",
    "def main():\n    return sum(range(10))\n",
    "你好，世界！机器学习很有趣。",
    "Emoji: 😀 🚀 👍🏽 ❤️ and accents: café naïve Ünïcödé.",
    "Hello, world! How are you today? I am fine, thank you.",
]

_ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "granite_moe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "phi": ("PhiConfig", "PhiForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
    "helium": ("HeliumConfig", "HeliumForCausalLM"),
    "olmo": ("OlmoConfig", "OlmoForCausalLM"),
    "opt": ("OPTConfig", "OPTForCausalLM"),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM"),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM"),
    "arcee": ("ArceeConfig", "ArceeForCausalLM"),
    "glm": ("GlmConfig", "GlmForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "falcon": ("FalconConfig", "FalconForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM"),
    "ministral": ("MinistralConfig", "MinistralForCausalLM"),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM"),
    "cohere": ("CohereConfig", "CohereForCausalLM"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    # Sequence classifiers: the same decoders with a score head (num_labels / id2label as overrides).
    "llama_classifier": ("LlamaConfig", "LlamaForSequenceClassification"),
    "qwen2_classifier": ("Qwen2Config", "Qwen2ForSequenceClassification"),
    "qwen3_classifier": ("Qwen3Config", "Qwen3ForSequenceClassification"),
    # Token classifiers: a score head (with a bias) read at every token.
    "llama_token_classifier": ("LlamaConfig", "LlamaForTokenClassification"),
    "qwen3_token_classifier": ("Qwen3Config", "Qwen3ForTokenClassification"),
}


@functools.lru_cache(maxsize=4)
def tiny_tokenizer_json(vocab_size: int = TINY_VOCAB_SIZE) -> str:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids, trained on a small
    fixed corpus (deterministic). Ids 0-2 are the ChatML special tokens; unused ids
    are padded with ``<|extra_N|>`` special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing < 0:
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet + specials")
    tokenizer.add_special_tokens([f"<|extra_{i}|>" for i in range(missing)])
    return tokenizer.to_str()


def write_tiny_hf_model(path: str | Path, arch: str = "llama", *, seed: int = 0,
                        max_shard_size: str | None = None, chat_template: str | None = CHATML_TEMPLATE,
                        **overrides: Any) -> Path:
    """Write a random-weight ``arch`` model (llama | qwen2 | mistral) as a HF directory
    with a tokenizer; ``overrides`` go to the transformers config (e.g.
    ``num_hidden_layers=4``, ``tie_word_embeddings=True``). ``max_shard_size`` (e.g.
    ``"100KB"``) writes sharded safetensors with an index."""
    import transformers

    config_name, model_name = _ARCH_CONFIGS[arch]
    settings: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    settings.update(overrides)
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    _randomize_norms(model)
    if arch == "gpt_oss":  # its experts' biases start at zero and its sinks near it: make both count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("_proj_bias", ".sinks")):
                    param.normal_(0.0, 0.5)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json(config.vocab_size))
    tokenizer_config: dict[str, Any] = {
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    return path


def with_renamed_tokens(path: Path, names: dict[str, str], special: Iterable[str]) -> Path:
    """The tiny model at ``path`` with some of its padding tokens renamed (``names``: old
    -> new, e.g. ``<|extra_0|>`` -> ``<think>``), those named in ``special`` special
    tokens and the others ordinary ones (a decoded text keeps them)."""
    special = set(special)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        text = (path / file).read_text()
        for old, new in names.items():
            text = text.replace(old, new)
        data = json.loads(text)
        for token in data.get("added_tokens", []) + list(data.get("added_tokens_decoder", {}).values()):
            if token["content"] in names.values():
                token["special"] = token["content"] in special
        (path / file).write_text(json.dumps(data))
    return path


def with_saved_masks(path: Path, out: Path) -> Path:
    """A copy of the GPT-2-named checkpoint at ``path`` with the causal-mask buffers older
    conversions saved beside the weights (``attn.bias``, ``attn.masked_bias``), at ``out``."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(path, out))
    state = load_file(str(copy / "model.safetensors"))
    state["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    state["transformer.h.1.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def write_hub_cache(cache: str | Path, repo_id: str, revisions: dict[str, Path], *,
                    tree_listing: bool = True, extra_files: dict[str, bytes] | None = None) -> dict[str, str]:
    """Lay model directories out in a Hugging Face hub cache the way huggingface_hub
    writes it: ``models--ORG--NAME/blobs/<hash>`` (sha256 for LFS files such as
    safetensors, git blob sha1 for the rest; shared between revisions),
    ``snapshots/<commit>/<file>`` as relative symlinks to the blobs, ``refs/<ref>``
    holding the commit hash, and ``trees/<commit>.json``, the file listing that
    huggingface_hub >= 2 caches. ``revisions`` maps a ref (branch or tag) to the
    directory its snapshot holds; ``extra_files`` (name -> bytes) go into every
    snapshot. Returns ``{ref: commit hash}``."""
    import hashlib

    storage = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    commits: dict[str, str] = {}
    for ref, source in revisions.items():
        files = {p.name: p.read_bytes() for p in sorted(Path(source).iterdir()) if p.is_file()}
        files.update(extra_files or {})
        commit = hashlib.sha1(repr((ref, sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items()))
                                   ).encode()).hexdigest()
        snapshot = storage / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        listing: dict[str, dict[str, Any]] = {}
        for name, data in files.items():
            git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            lfs = name.endswith(".safetensors")
            blob = storage / "blobs" / (hashlib.sha256(data).hexdigest() if lfs else git_sha1)
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():
                blob.write_bytes(data)
            (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
            listing[name] = {"size": len(data), "blob_id": git_sha1}
            if lfs:
                listing[name].update(lfs_sha256=blob.name, lfs_size=len(data))
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no trailing newline, as huggingface_hub writes it
        if tree_listing:
            (storage / "trees").mkdir(exist_ok=True)
            (storage / "trees" / f"{commit}.json").write_text(
                json.dumps({"format_version": 1, "files": listing}, indent=1))
        commits[ref] = commit
    return commits


def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights are initialised to ones; perturb them so a loader that swaps two
    norms (or drops one) is caught by an equality test."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".norms." in name:  # StableLM's per-head norms: norms.<head>.weight
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.02)


def tiny_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The parameters of a tiny model directory, read back with transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# GGUF block tensor names, by HF suffix (llama.cpp's standard names).
_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused tensors, kept fused
    "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",  # StarCoder2's plain MLP
    "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down", "self_attn.dense": "attn_output",  # Phi's
    "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",  # GPT-NeoX's
    "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
    "ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",  # GPT-2's
    "ln_attn": "attn_norm", "ln_mlp": "attn_norm_2",  # Falcon-40B's two norms side by side
    "self_attention.query_key_value": "attn_qkv", "self_attention.dense": "attn_output",  # Falcon's
}


# Gemma 2 and 3's block norms as llama.cpp's converter names them (Llama's ffn_norm is
# their pre-feedforward norm).
_GGUF_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                     "post_feedforward_layernorm": "post_ffw_norm"}


def write_tiny_gguf(hf_dir: str | Path, out: str | Path, arch: str | None = None,
                    permute_qk: bool | None = None) -> Path:
    """Convert a tiny HF directory to an F32 GGUF as llama.cpp's converter does: GGUF
    names, Q/K rows permuted for llama-family models, gpt2 tokenizer metadata; Gemma's
    norms stored as 1 + weight, its caps and window as metadata (llama.cpp's GemmaModel,
    Gemma2Model, Gemma3Model). ``arch`` overrides ``general.architecture`` (to test
    unsupported ones)."""
    import gguf
    from safetensors.torch import load_file

    from kvloom.models.gguf_loader import permute_rows

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config["model_type"]
    if model_type == "gpt2":  # its own names; llama.cpp's GPT2Model writes 4 x hidden as the MLP's width
        config = {**config, "num_hidden_layers": config["n_layer"], "hidden_size": config["n_embd"],
                  "num_attention_heads": config["n_head"], "num_key_value_heads": config["n_head"],
                  "max_position_embeddings": config["n_positions"], "intermediate_size": 4 * config["n_embd"],
                  "layer_norm_eps": config["layer_norm_epsilon"]}
    falcon_kv_heads = 0
    if model_type == "falcon":  # as llama.cpp's FalconModel: 2,048 positions, 4 x hidden as the MLP's width
        new_architecture = config.get("new_decoder_architecture", False)
        falcon_kv_heads = 1 if config.get("multi_query", True) and not new_architecture else config["num_kv_heads"]
        config = {**config, "num_key_value_heads": falcon_kv_heads, "max_position_embeddings": 2048,
                  "intermediate_size": 4 * config["hidden_size"], "layer_norm_eps": config["layer_norm_epsilon"]}
    gemma = model_type in ("gemma", "gemma2", "gemma3_text")
    arch = arch or {"gemma3_text": "gemma3", "olmo3": "olmo2", "phi": "phi2", "gpt_neox": "gptneox"}.get(model_type,
                                                                                                     model_type)
    if permute_qk is None:
        permute_qk = model_type in ("llama", "mistral", "granite", "smollm3", "olmo", "arcee")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(shard)))

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    phi = model_type == "phi"  # llama.cpp's Phi2Model writes 4 x hidden as the MLP's width, every head a KV head
    writer.add_feed_forward_length(4 * config["hidden_size"] if phi else config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    if model_type != "gpt_neox":  # llama.cpp's GPTNeoXModel writes no KV head count
        writer.add_head_count_kv(config["num_attention_heads" if phi else "num_key_value_heads"])
    rope_parameters = config.get("rope_parameters", {})
    rope_parameters = rope_parameters.get("full_attention", rope_parameters)  # Gemma 3's: the global layers'
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope_parameters.get("rope_theta", 1e4)))
    if "rms_norm_eps" in config:  # (LayerNorm families write layer_norm_eps below)
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim"):  # as llama.cpp's converter: a head_dim the config states is written
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    _add_gguf_tokenizer(writer, hf_dir)
    if model_type == "granite":  # as llama.cpp's GraniteModel: the multipliers as metadata
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    if model_type == "phi3":  # as llama.cpp's Phi3MiniModel: rotary dims, and LongRoPE's factors as tensors
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        writer.add_rope_dimension_count(int(head_dim * partial))
        if rope.get("rope_type", rope.get("type")) == "longrope":
            original = rope.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_orig_ctx_len(original)
            writer.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) /
                                                                                   math.log(original)))
            writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if model_type in ("gemma2", "gemma3_text"):  # the caps and the window; the layer pattern is llama.cpp's own
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    if model_type == "starcoder2":  # LayerNorm's eps (the converter's layer_norm_eps) and the window
        writer.add_layer_norm_eps(config["norm_epsilon"])
        writer.add_sliding_window(config["sliding_window"])
    if phi:  # as llama.cpp's Phi2Model: LayerNorm's eps and the rotary's dims
        writer.add_layer_norm_eps(config["layer_norm_eps"])
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        writer.add_rope_dimension_count(int(config["rope_parameters"]["partial_rotary_factor"] * head_dim))
    if model_type == "olmo" and config.get("clip_qkv") is not None:  # as llama.cpp's OlmoModel
        writer.add_clamp_kqv(config["clip_qkv"])
    if model_type == "stablelm":  # as llama.cpp's StableLMModel: its per-head q/k norms stacked below
        writer.add_layer_norm_eps(config["layer_norm_eps"])
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        writer.add_rope_dimension_count(int(config["rope_parameters"]["partial_rotary_factor"] * head_dim))
        writer.add_parallel_residual(config["use_parallel_residual"])
    if model_type == "nemotron":  # as llama.cpp's NemotronModel: LayerNorm's eps, the rotary's dims
        writer.add_layer_norm_eps(config["norm_eps"])
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        partial = config.get("partial_rotary_factor") or config["rope_parameters"]["partial_rotary_factor"]
        writer.add_rope_dimension_count(int(partial * head_dim))
    if model_type == "falcon":  # LayerNorm's eps; q/k/v regrouped [q | k | v] below ("jploski" layout)
        writer.add_layer_norm_eps(config["layer_norm_eps"])
    if model_type == "gpt2":  # LayerNorm's eps; its Conv1D weights transposed below
        writer.add_layer_norm_eps(config["layer_norm_eps"])
    if model_type == "gpt_neox":  # as llama.cpp's GPTNeoXModel: q/k/v regrouped [q | k | v] below
        writer.add_layer_norm_eps(config["layer_norm_eps"])
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        writer.add_rope_dimension_count(int(config["rope_parameters"]["partial_rotary_factor"] * head_dim))
        writer.add_parallel_residual(config["use_parallel_residual"])
    if model_type == "olmo3" or (model_type == "exaone4" and config.get("sliding_window")):  # as llama.cpp's
        # Olmo2Model and Exaone4Model: the window and which layers have it
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config.get("num_key_value_heads")}
    state = _stacked_head_norms(state)  # StableLM's: one [heads, head_dim] tensor, as llama.cpp stacks them
    for name, tensor in state.items():
        array = tensor.float().numpy()
        name = name.replace("gpt_neox.layers.", "model.layers.").replace("transformer.h.", "model.layers.")
        if model_type == "gpt2" and array.ndim == 2 and name.endswith(("c_attn.weight", "c_proj.weight",
                                                                          "c_fc.weight")):
            array = array.T  # Conv1D's [in, out] as llama.cpp stores a matmul: [out, in]
        if model_type == "falcon" and "query_key_value" in name:  # each KV group's queries, k, v -> [q | k | v]
            heads, head_dim = config["num_attention_heads"], config["hidden_size"] // config["num_attention_heads"]
            grouped = array.reshape(falcon_kv_heads, heads // falcon_kv_heads + 2, head_dim, *array.shape[1:])
            array = np.concatenate([grouped[:, :-2].reshape(heads * head_dim, *array.shape[1:]),
                                    grouped[:, -2].reshape(falcon_kv_heads * head_dim, *array.shape[1:]),
                                    grouped[:, -1].reshape(falcon_kv_heads * head_dim, *array.shape[1:])])
        elif name.endswith(("attention.query_key_value.weight", "attention.query_key_value.bias")):
            per_head = array.reshape(config["num_attention_heads"], 3, -1, *array.shape[1:])
            array = per_head.swapaxes(0, 1).reshape(array.shape)  # [head][q | k | v] -> [q | k | v]
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            block = {**_GGUF_BLOCK, **_GGUF_GEMMA_NORMS} if model_type in ("gemma2", "gemma3_text", "olmo2",
                                                                           "olmo3", "exaone4") else _GGUF_BLOCK
            gguf_name = f"blk.{layer}.{block[module]}.{kind}"
            proj = module.rsplit(".", 1)[-1]
            if permute_qk and proj in heads and kind == "weight":
                array = permute_rows(array, heads[proj])
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight", "model.norm.bias": "output_norm.bias",
                         "model.final_layernorm.weight": "output_norm.weight",  # Phi's
                         "model.final_layernorm.bias": "output_norm.bias",
                         "gpt_neox.embed_in.weight": "token_embd.weight", "embed_out.weight": "output.weight",
                         "transformer.wte.weight": "token_embd.weight",
                         "transformer.word_embeddings.weight": "token_embd.weight",
                         "transformer.wpe.weight": "position_embd.weight",
                         "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias",
                         "gpt_neox.final_layer_norm.weight": "output_norm.weight",
                         "gpt_neox.final_layer_norm.bias": "output_norm.bias",
                         "lm_head.weight": "output.weight", "lm_head.bias": "output.bias"}[name]
            if gguf_name == "output.weight" and config.get("tie_word_embeddings"):
                continue
        if (gemma or model_type == "nemotron") and name.endswith("norm.weight"):
            array = array + 1  # what llama.cpp's Gemma norms multiply by, and its Nemotron LayerNorm1P weights
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _stacked_head_norms(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``...self_attn.{q,k}_layernorm.norms.<head>.weight`` as one ``...self_attn.{q,k}_norm.weight``
    of [heads, head_dim]; every other tensor as it is."""
    import re

    out: dict[str, torch.Tensor] = {}
    heads: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = re.fullmatch(r"(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight", name)
        if match is None:
            out[name] = tensor
        else:
            heads.setdefault(f"{match[1]}{match[2]}_norm.weight", {})[int(match[3])] = tensor
    for name, parts in heads.items():
        out[name] = torch.stack([parts[h] for h in sorted(parts)])
    return out


def _add_gguf_tokenizer(writer: Any, hf_dir: Path) -> None:
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab.update(special)
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if tok in special else 1 for tok in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token", False)))
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])


def default_model_path() -> Path:
    """The default model's GGUF (downloaded once into ``$KVLOOM_HOME`` or
    ``~/.cache/kvloom``; later calls reuse it)."""
    from kvloom.models.default_model import resolve_default_model

    return resolve_default_model()


def hf_greedy_with_cache(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own KV-cached forward, argmax each step, eos not special-cased."""
    tokens: list[int] = []
    past, inputs = None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(inputs, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            inputs = torch.tensor([[tokens[-1]]])
    return tokens


def hf_greedy_batched(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """:func:`hf_greedy_with_cache` for several prompts in one batch of transformers'
    forwards: left-padded, the padding masked out and each row's positions counted from
    its first real token (as transformers' generate does). One forward a step for all the
    prompts instead of one each: the default model's 8 x 32 tokens take ~4 s instead of
    ~17 s on 2 cores. A row's values round as a batch of that size does, not as one prompt
    alone; the tokens compared are the same wherever no two logits are within a rounding."""
    longest = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (longest - len(prompt)) + prompt for prompt in prompts])
    mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens: list[list[int]] = [[] for _ in prompts]
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
            past = out.past_key_values
            chosen = out.logits[:, -1].argmax(-1)
            for row, token in enumerate(chosen.tolist()):
                tokens[row].append(int(token))
            ids = chosen[:, None]
            mask = torch.cat((mask, torch.ones(len(prompts), 1, dtype=mask.dtype)), dim=1)
            positions = positions[:, -1:] + 1
    return tokens


# HF model_type -> the general.architecture llama.cpp's converter gives it.
_GGUF_FAMILY_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "deepseek_v2": "deepseek2",
                     "deepseek_v3": "deepseek2", "mamba2": "mamba2", "bamba": "granitehybrid",
                     "granitemoe": "granitemoe", "gpt_oss": "gpt-oss", "granitemoehybrid": "granitehybrid"}
# HF module -> GGUF block part, for the families' own modules (beyond _GGUF_BLOCK).
_GGUF_FAMILY_BLOCK = {
    **_GGUF_BLOCK, "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    **{f"mlp.{shared}.{proj}_proj": f"ffn_{proj}_shexp" for shared in ("shared_expert", "shared_experts")
       for proj in ("gate", "up", "down")},
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_b_proj": "attn_q_b", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "norm": "attn_norm", "mixer.in_proj": "ssm_in", "mixer.conv1d": "ssm_conv1d", "mixer.out_proj": "ssm_out",
    "mamba.in_proj": "ssm_in", "mamba.conv1d": "ssm_conv1d", "mamba.out_proj": "ssm_out",
    "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down",
    "pre_ff_layernorm": "ffn_norm",
}
_GGUF_EXPERT_PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                     "down_proj": "down"}


def _write_gpt_oss_tensor(writer: Any, block: str, rest: str, array: np.ndarray, mxfp4: bool) -> None:
    """One GPT-OSS layer tensor of its own kinds, as llama.cpp's GptOssModel writes it."""
    import gguf

    def add(name: str, value: np.ndarray, quantize: bool = False) -> None:
        value = np.ascontiguousarray(value)
        if quantize:
            packed = gguf.quants.quantize(value, gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(name, value)

    if rest == "self_attn.sinks":
        add(f"{block}.attn_sinks.weight", array)
    elif rest == "post_attention_layernorm.weight":
        add(f"{block}.post_attention_norm.weight", array)
    elif rest in ("mlp.router.weight", "mlp.router.bias"):
        add(f"{block}.ffn_gate_inp.{rest.rsplit('.', 1)[1]}", array)
    elif rest == "mlp.experts.gate_up_proj":  # [E, hidden, 2 inter] -> [E, 2 inter, hidden], outputs alternating
        turned = array.transpose(0, 2, 1)
        add(f"{block}.ffn_gate_exps.weight", turned[:, 0::2], mxfp4)
        add(f"{block}.ffn_up_exps.weight", turned[:, 1::2], mxfp4)
    elif rest == "mlp.experts.gate_up_proj_bias":
        add(f"{block}.ffn_gate_exps.bias", array[:, 0::2])
        add(f"{block}.ffn_up_exps.bias", array[:, 1::2])
    elif rest == "mlp.experts.down_proj":  # [E, inter, hidden] -> [E, hidden, inter]
        add(f"{block}.ffn_down_exps.weight", array.transpose(0, 2, 1), mxfp4)
    elif rest == "mlp.experts.down_proj_bias":
        add(f"{block}.ffn_down_exps.bias", array)
    else:
        raise ValueError(f"no GGUF name for GPT-OSS tensor {rest!r}")


def write_tiny_gguf_family(hf_dir: str | Path, out: str | Path, *, split_kv_b: bool = True,
                           stack_experts: bool = True, mxfp4_experts: bool = False) -> Path:
    """Convert a tiny Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, Mamba2 or Bamba HF directory to an
    F32 GGUF as llama.cpp's convert_hf_to_gguf.py does: its metadata keys, experts stacked
    into ``ffn_*_exps`` [experts, out, in], Mixtral's and Bamba's Q/K rows permuted; DeepSeek's
    kv_b_proj split per head into k_b (transposed) and v_b with head_count_kv 1 and the
    per-head lengths in ``*_mla`` (``split_kv_b=False``: an older converter's file,
    kv_b whole and the per-head lengths in key_length / value_length); Mamba2's A_log as
    -exp(A_log), A and D as [heads, 1], the norm as [groups, d_inner / groups], conv1d
    squeezed, dt_bias as ``ssm_dt.bias``, context length 2**20; Bamba (granitehybrid) with
    Mamba2's mixer tensors and keys, head_count_kv per layer (0 in the mixers), rope
    dimension head_dim and rope.scaling.finetuned. ``stack_experts=False``: a converter
    from before April 2024, one ``ffn_gate.E`` tensor per expert. GPT-OSS (gpt-oss) as its GptOssModel
    writes it: the window, the expert width and YaRN in the metadata, sinks as
    ``attn_sinks``, the fused gate_up split back into ``ffn_gate_exps`` / ``ffn_up_exps``
    ([experts, inter, hidden], gate the even outputs) and its bias likewise, down turned to
    [experts, hidden, inter]; ``mxfp4_experts``: those expert matrices stored as MXFP4
    (the weights must be MXFP4 numbers already for the file to hold them exactly)."""
    import re

    import gguf
    from safetensors.torch import load_file

    from kvloom.models.gguf_loader import permute_rows

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config["model_type"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    writer = gguf.GGUFWriter(str(out), _GGUF_FAMILY_ARCH[model_type])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    deepseek, mamba = model_type.startswith("deepseek"), model_type == "mamba2"
    granite_4 = model_type == "granitemoehybrid"
    bamba = model_type == "bamba" or granite_4  # GraniteHybridModel writes both
    heads = config.get("num_attention_heads", 0)
    mixer = "mamba" if bamba else "mixer"  # the HF module of Mamba2's mixer
    attention_layers = (config["attn_layer_indices"] if model_type == "bamba" else
                        [i for i, kind in enumerate(config.get("layer_types") or ()) if kind in ("attention",
                                                                                               "full_attention")])
    has_experts = bool(config.get("num_local_experts"))
    if mamba:
        inner = config["expand"] * config["hidden_size"]
        writer.add_context_length(2**20)
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(config["conv_kernel"])
        writer.add_ssm_inner_size(inner)
        writer.add_ssm_state_size(config["state_size"])
        writer.add_ssm_time_step_rank(inner // config["head_dim"])
        writer.add_ssm_group_count(config["n_groups"])
        writer.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
    else:
        # (The converter's placeholder for a Granite 4.0 hybrid, which turns no rope.)
        writer.add_context_length(2**20 if granite_4 else config["max_position_embeddings"])
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(heads)
        if bamba:  # GraniteHybridModel: per layer, 0 in the mixers
            writer.add_head_count_kv([config["num_key_value_heads"] if i in attention_layers else 0
                                      for i in range(config["num_hidden_layers"])])
        else:
            writer.add_head_count_kv(1 if deepseek and split_kv_b else config["num_key_value_heads"])
        writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
        if experts:
            writer.add_expert_count(experts)
            writer.add_expert_used_count(config["num_experts_per_tok"])
    if model_type in ("mixtral", "granitemoe"):
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    if model_type in ("granitemoe", "granitemoehybrid"):  # GraniteMoeModel: Granite's multipliers
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    if granite_4:  # GraniteMoeSharedModel's shared width
        writer.add_expert_shared_feed_forward_length(config["shared_intermediate_size"])
    if bamba:
        # LlamaModel's rope dimension (GraniteModel drops head_dim), unless attn_rotary_emb.
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("attn_rotary_emb") or config["hidden_size"] // heads)
        # Bamba uses rope; a Granite 4.0 hybrid never, whatever its config (the converter's use_rope).
        writer.add_rope_scaling_finetuned(not granite_4)
        writer.add_ssm_conv_kernel(config["mamba_d_conv"])
        writer.add_ssm_state_size(config["mamba_d_state"])
        writer.add_ssm_group_count(config["mamba_n_groups"])
        writer.add_ssm_inner_size(config["mamba_expand"] * config["hidden_size"])
        writer.add_ssm_time_step_rank(config["mamba_n_heads"])
    elif model_type == "gpt_oss":
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_sliding_window(config["sliding_window"])
        rope = config["rope_parameters"]
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif model_type == "qwen2_moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    elif model_type == "qwen3_moe":  # Qwen3MoeModel: the expert width and the stated head_dim
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    elif deepseek:
        rank, rope, nope, v_dim = (config[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                        "v_head_dim"))
        if config.get("n_group") is not None:
            writer.add_expert_group_count(config["n_group"])
        if config.get("topk_group") is not None:
            writer.add_expert_group_used_count(config["topk_group"])
        # The hub's configs say scoring_func (transformers' own omit it): V2 softmax, V3 sigmoid.
        v3 = model_type == "deepseek_v3"
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_vocab_size(config["vocab_size"])
        if config.get("q_lora_rank") is not None:
            writer.add_q_lora_rank(config["q_lora_rank"])
        writer.add_kv_lora_rank(rank)
        if split_kv_b:
            writer.add_key_length(rank + rope)
            writer.add_value_length(rank)
            writer.add_key_length_mla(nope + rope)
            writer.add_value_length_mla(v_dim)
        else:
            writer.add_key_length(nope + rope)
            writer.add_value_length(v_dim)
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        if config.get("norm_topk_prob"):
            writer.add_expert_weights_norm(True)
        writer.add_rope_dimension_count(rope)
    _add_gguf_tokenizer(writer, hf_dir)

    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        array = tensor.float().numpy()
        top = {"model.embed_tokens.weight": "token_embd.weight", "backbone.embeddings.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "backbone.norm_f.weight": "output_norm.weight",
               "model.final_layernorm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
        if name in top:
            if not (name == "lm_head.weight" and config.get("tie_word_embeddings")):
                writer.add_tensor(top[name], np.ascontiguousarray(array))
            continue
        layer, rest = name.split(".layers.", 1)[1].split(".", 1)
        if model_type == "gpt_oss" and rest.startswith(("mlp.", "self_attn.sinks", "post_attention_layernorm")):
            _write_gpt_oss_tensor(writer, f"blk.{layer}", rest, array, mxfp4_experts)
            continue
        # GraniteMoe's fused experts ([E, 2 inter, hidden]) and Granite 4.0's fused shared MLP
        # ([2 inter, hidden]: the shared expert beside experts, else the MLP), gate and up split
        # apart as their converters write them: (the parts' suffix, the axis of gate | up).
        shared = "_shexp" if has_experts else ""
        fused = {"block_sparse_moe.input_linear.weight": ("_exps", 1), "shared_mlp.input_linear.weight": (shared, 0),
                 "block_sparse_moe.output_linear.weight": ("_exps", None),
                 "shared_mlp.output_linear.weight": (shared, None)}
        if rest in fused:
            suffix, axis = fused[rest]
            parts = dict(zip(("gate", "up"), np.split(array, 2, axis=axis), strict=True)) if axis is not None else {
                "down": array}
            for part, value in parts.items():
                writer.add_tensor(f"blk.{layer}.ffn_{part}{suffix}.weight", np.ascontiguousarray(value))
            continue
        if rest == "block_sparse_moe.router.layer.weight":
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", np.ascontiguousarray(array))
            continue
        expert = re.fullmatch(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight", rest)
        if expert:
            stacked.setdefault((layer, _GGUF_EXPERT_PROJ[expert.group(2)]), {})[int(expert.group(1))] = array
            continue
        module, kind = rest.rsplit(".", 1)
        gguf_name, array = _mamba2_gguf_tensor(layer, rest, mixer, config["mamba_n_groups"] if bamba else
                                               config.get("n_groups", 1), array)
        if rest == "mlp.gate.e_score_correction_bias":
            gguf_name = f"blk.{layer}.exp_probs_b.bias"
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            kv_b = array.reshape(heads, nope + v_dim, rank)
            k_b, v_b = kv_b[:, :nope], kv_b[:, nope:]
            writer.add_tensor(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(k_b.transpose(0, 2, 1)))
            writer.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(v_b))
            continue
        elif model_type in ("mixtral", "bamba", "granitemoe", "granitemoehybrid") and module in ("self_attn.q_proj",
                                                                                              "self_attn.k_proj"):
            array = permute_rows(array, heads if module.endswith("q_proj") else config["num_key_value_heads"])
        writer.add_tensor(gguf_name or f"blk.{layer}.{_GGUF_FAMILY_BLOCK[module]}.{kind}", np.ascontiguousarray(array))
    for (layer, proj), by_expert in stacked.items():
        if not stack_experts:
            for expert_index, array in sorted(by_expert.items()):
                writer.add_tensor(f"blk.{layer}.ffn_{proj}.{expert_index}.weight", np.ascontiguousarray(array))
            continue
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight",
                          np.ascontiguousarray(np.stack([by_expert[e] for e in sorted(by_expert)])))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# LFM2's modules -> llama.cpp's LFM2 block parts (LFM2Model: no Q/K reordering, its rotary
# pairs halves as HF's; the conv's weight squeezed to [channels, kernel]).
_GGUF_LFM2_BLOCK = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_proj": "attn_q",
                    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
                    "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
                    "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
                    "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj",
                    "conv.out_proj": "shortconv.out_proj", "feed_forward.gate": "ffn_gate_inp"}


def write_tiny_lfm2_gguf(hf_dir: str | Path, out: str | Path) -> Path:
    """Convert a tiny LFM2 HF directory to an F32 GGUF as llama.cpp's LFM2Model writes it:
    head_count_kv per layer (0 in the conv layers), the MLP's width after transformers'
    adjustment as feed_forward_length, shortconv.l_cache, the final norm (HF's
    embedding_norm) as token_embd_norm, no output tensor where the head is tied. An LFM2-MoE
    directory as its LFM2MoeModel writes it (``lfm2moe``): the dense width as it is, the experts'
    count, top-k, width and sigmoid gating, the dense layers' count, the router as ffn_gate_inp,
    the selection bias as exp_probs_b.bias, each expert's w1 / w3 / w2 stacked into
    ffn_gate_exps / ffn_up_exps / ffn_down_exps [experts, out, in]."""
    import gguf
    from safetensors.torch import load_file

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    moe = config["model_type"] == "lfm2_moe"
    writer = gguf.GGUFWriter(str(out), "lfm2moe" if moe else "lfm2")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    if moe:
        width = config["intermediate_size"]
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_leading_dense_block_count(config["num_dense_layers"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:
        width = int(2 * config["intermediate_size"] / 3)  # LFM2Model._add_feed_forward_length
        multiple = config["block_multiple_of"]
        width = multiple * ((int(config["block_ffn_dim_multiplier"] * width) + multiple - 1) // multiple)
    writer.add_feed_forward_length(width)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv([config["num_key_value_heads"] if kind != "conv" else 0 for kind in config["layer_types"]])
    writer.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_shortconv_l_cache(config["conv_L_cache"])
    _add_gguf_tokenizer(writer, hf_dir)
    experts: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}  # (layer, w1 / w3 / w2) -> each expert's
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if ".feed_forward.experts." in name:
            layer, rest = name.split(".layers.", 1)[1].split(".", 1)
            index, part = rest.split(".")[2:4]
            experts.setdefault((layer, part), []).append((int(index), array))
            continue
        if name.endswith(".feed_forward.expert_bias"):
            writer.add_tensor(f"blk.{name.split('.layers.', 1)[1].split('.', 1)[0]}.exp_probs_b.bias", array)
            continue
        if name in ("model.embed_tokens.weight", "model.embedding_norm.weight", "lm_head.weight"):
            if name != "lm_head.weight" or not config.get("tie_word_embeddings"):
                gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                             "model.embedding_norm.weight": "token_embd_norm.weight"}[name]
                writer.add_tensor(gguf_name, np.ascontiguousarray(array))
            continue
        layer, rest = name.split(".layers.", 1)[1].split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if module == "conv.conv" and kind == "weight":
            array = array.squeeze(1)
        writer.add_tensor(f"blk.{layer}.{_GGUF_LFM2_BLOCK[module]}.{kind}", np.ascontiguousarray(array))
    for (layer, part), arrays in experts.items():
        stacked = np.stack([array for _, array in sorted(arrays, key=lambda pair: pair[0])])
        writer.add_tensor(f"blk.{layer}.ffn_{dict(w1='gate', w3='up', w2='down')[part]}_exps.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _mamba2_gguf_tensor(layer: str, rest: str, mixer: str, groups: int, array: np.ndarray
                        ) -> tuple[str | None, np.ndarray]:
    """A Mamba2 mixer's tensor (``rest`` inside layer ``layer``; the mixer's HF module
    ``mixer``) as llama.cpp's Mamba2Model stores it: A as -exp(A_log) and D as [heads, 1],
    dt_bias as ``ssm_dt.bias``, the gated norm as [groups, d_inner / groups], conv1d squeezed
    to [channels, kernel]. (Its GGUF name where it is not the module's, else None; the array.)"""
    if rest == f"{mixer}.A_log":
        return f"blk.{layer}.ssm_a", (-torch.exp(torch.from_numpy(array))).numpy().reshape(-1, 1)
    if rest == f"{mixer}.D":
        return f"blk.{layer}.ssm_d", array.reshape(-1, 1)
    if rest == f"{mixer}.dt_bias":
        return f"blk.{layer}.ssm_dt.bias", array
    if rest == f"{mixer}.norm.weight":
        return f"blk.{layer}.ssm_norm.weight", array.reshape(groups, -1)
    if rest == f"{mixer}.conv1d.weight":
        return None, array.squeeze(1)
    return None, array


# Nemotron-H's block modules -> llama.cpp's parts (every block's norm is attn_norm).
_GGUF_NEMOTRON_H_BLOCK = {"norm": "attn_norm", "mixer.in_proj": "ssm_in", "mixer.conv1d": "ssm_conv1d",
                          "mixer.out_proj": "ssm_out", "mixer.q_proj": "attn_q", "mixer.k_proj": "attn_k",
                          "mixer.v_proj": "attn_v", "mixer.o_proj": "attn_output", "mixer.up_proj": "ffn_up",
                          "mixer.down_proj": "ffn_down", "mixer.gate": "ffn_gate_inp",
                          "mixer.shared_experts.up_proj": "ffn_up_shexp",
                          "mixer.shared_experts.down_proj": "ffn_down_shexp"}


def write_tiny_nemotron_h_gguf(hf_dir: str | Path, out: str | Path) -> Path:
    """Convert a tiny Nemotron-H HF directory to an F32 GGUF as llama.cpp's NemotronHModel
    (on GraniteHybridModel) writes it: head_count_kv per block (0 outside attention),
    feed_forward_length per block (0 outside the MLPs), key_length, the ssm keys, no rope
    (context_length 2**20), the config's layer_norm_epsilon as the LayerNorm eps key; the
    mixers as Mamba2's (A as -exp(A_log), [heads, 1]; D [heads, 1]; the gated norm [groups,
    d_inner / groups]; conv1d squeezed), the attention's q/k rows permuted as LlamaModel
    does; the checkpoint's lm_head as the output tensor (transformers never ties Nemotron-H's)."""
    import gguf
    from safetensors.torch import load_file

    from kvloom.models.gguf_loader import permute_rows

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "linear_attention": "mamba",
             "full_attention": "attention"}
    kinds = [names.get(k, k) for k in (config.get("layers_block_type") or config["hybrid_override_pattern"])]
    moe = "moe" in kinds  # Nemotron 3: its MoE form (the converter's is_moe), its MoE blocks the "MLP" ones
    writer = gguf.GGUFWriter(str(out), "nemotron_h_moe" if moe else "nemotron_h")
    writer.add_block_count(len(kinds))
    writer.add_context_length(2**20)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv([config["num_key_value_heads"] if kind == "attention" else 0 for kind in kinds])
    if moe:
        writer.add_feed_forward_length([config["moe_intermediate_size"] if kind == "moe" else 0 for kind in kinds])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["moe_shared_expert_intermediate_size"])
        writer.add_expert_count(config["n_routed_experts"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_group_count(config["n_group"])
    else:
        writer.add_feed_forward_length([config["intermediate_size"] if kind == "mlp" else 0 for kind in kinds])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_rope_scaling_finetuned(False)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_ssm_conv_kernel(config["conv_kernel"])
    writer.add_ssm_state_size(config["ssm_state_size"])
    writer.add_ssm_group_count(config["n_groups"])
    writer.add_ssm_inner_size(config["mamba_num_heads"] * config["mamba_head_dim"])
    writer.add_ssm_time_step_rank(config["mamba_num_heads"])
    _add_gguf_tokenizer(writer, hf_dir)
    top = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    experts: dict[tuple[str, str], list[tuple[int, np.ndarray]]] = {}  # (block, up / down) -> each expert's
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if name in top:
            writer.add_tensor(top[name], np.ascontiguousarray(array))
            continue
        layer, rest = name.split(".layers.", 1)[1].split(".", 1)
        if rest.startswith("mixer.experts."):  # mixer.experts.E.{up,down}_proj.weight: stacked below
            index, part = rest.split(".")[2:4]
            experts.setdefault((layer, part), []).append((int(index), array))
            continue
        if rest == "mixer.gate.e_score_correction_bias":
            writer.add_tensor(f"blk.{layer}.exp_probs_b.bias", array)
            continue
        module, kind = rest.rsplit(".", 1)
        gguf_name, array = _mamba2_gguf_tensor(layer, rest, "mixer", config["n_groups"], array)
        if module in ("mixer.q_proj", "mixer.k_proj"):
            heads = config["num_attention_heads" if module == "mixer.q_proj" else "num_key_value_heads"]
            array = permute_rows(array, heads)
        writer.add_tensor(gguf_name or f"blk.{layer}.{_GGUF_NEMOTRON_H_BLOCK[module]}.{kind}",
                          np.ascontiguousarray(array))
    for (layer, part), arrays in experts.items():
        stacked = np.stack([array for _, array in sorted(arrays, key=lambda pair: pair[0])])
        writer.add_tensor(f"blk.{layer}.ffn_{part.removesuffix('_proj')}_exps.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def hf_greedy_tokens(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation by full recompute each step (no cache at all):
    the reference the parity tests hold kvloom's tokens to."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_greedy_and_first_logprobs(path: str | Path, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """The model directory's transformers greedy tokens, recomputing the whole sequence
    each step (so that what depends on the sequence's length, LongRoPE's factors, follows
    it), and its log-probs at the prompt's last position."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids: list[int] = list(prompt)
    first: torch.Tensor | None = None
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            first = torch.log_softmax(logits, -1) if first is None else first
            ids.append(int(logits.argmax()))
    assert first is not None
    return ids[len(prompt):], first


def assert_bf16_walk_near_float32(path: str | Path, prompts: list[list[int]], **engine: Any) -> None:
    """bf16 on a CPU runs the native walk (csrc/decoder_stack.cpp): each prompt's
    first-token log-probs (its 20 likeliest) lie within bf16's error of transformers'
    float32 ones (transformers' own bf16 run lies 0.004-0.012 from them on the tiny Gemmas),
    and its greedy token is float32's wherever float32's top two are apart."""
    from kvloom import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", block_size=16, num_blocks=64, max_num_batched_tokens=16, **engine)
    assert llm.engine.model.native_stack is not None
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))
    for output, prompt in zip(outputs, prompts, strict=True):
        _, reference = hf_greedy_and_first_logprobs(path, prompt, 1)
        ours = output.outputs[0].logprobs[0]
        assert max(abs(entry.logprob - reference[token].item()) for token, entry in ours.items()) < 0.03, prompt
        top2 = reference.topk(2).values
        if top2[0] - top2[1] > 0.03:
            assert output.outputs[0].token_ids[0] == int(reference.argmax()), prompt


def assert_greedy_is_transformers(path: Path, prompts: list[list[int]], max_tokens: int, **engine: Any) -> Any:
    """kvloom's float32 greedy tokens for each prompt, prefills chunked at 16 tokens, equal
    transformers' (``hf_greedy_and_first_logprobs``), and the first token's log-prob within
    1e-4 of its; returns the LLM (``engine``: more of its arguments)."""
    import pytest

    from kvloom import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=16, **engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    try:
        for output, prompt in zip(llm.generate(prompts, params), prompts, strict=True):
            tokens, first = hf_greedy_and_first_logprobs(path, prompt, max_tokens)
            assert list(output.outputs[0].token_ids) == tokens, prompt
            assert output.outputs[0].logprobs[0][tokens[0]].logprob == pytest.approx(first[tokens[0]].item(),
                                                                                     abs=1e-4)
    finally:
        # Ranks go now, with their process group (this process is rank 0): left to the
        # garbage collector, a later test's ranks in this worker could find the group still there.
        if engine.get("tensor_parallel_size", 1) > 1:
            llm.shutdown()
    return llm

