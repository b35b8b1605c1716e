"""bf16 greedy tokens and top-5 logprobs of tiny models of many families, as JSON (A/B of the build dtype)."""
import json, random, sys
from pathlib import Path
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/models")
from helpers_models import write_tiny_hf_model
from helpers_ssm import write_tiny_ssm_model
from kvloom import LLM, SamplingParams
root = Path("/tmp/ab_dtype/models")
ARCHS = {
    "llama": {}, "qwen2": {}, "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "gemma2": {}, "gemma3": {}, "olmo2": {}, "phi": {}, "gpt_neox": {}, "gpt2": {}, "starcoder2": {}, "stablelm": {},
    "falcon": {}, "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, max_position_embeddings=4096),
    "deepseek_v3": dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, q_lora_rank=None, n_group=2, topk_group=1),
    "phi3": {}, "granite": {}, "cohere": {}, "exaone4": {}, "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}
rng = random.Random(5)
prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 23)]
out = {}
for arch, kw in ARCHS.items():
    path = root / arch
    if not (path / "config.json").exists():
        write_tiny_hf_model(path, arch=arch, seed=3, **kw)
    llm = LLM(str(path), dtype="bfloat16", num_blocks=32, block_size=16)
    res = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5))
    out[arch] = [[list(o.outputs[0].token_ids), [{str(t): e.logprob for t, e in lp.items()} for lp in o.outputs[0].logprobs]] for o in res]
for kind in ("mamba2", "bamba"):
    path = root / kind
    if not (path / "config.json").exists():
        write_tiny_ssm_model(path, kind)
    llm = LLM(str(path), dtype="bfloat16", num_blocks=32, block_size=16)
    res = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5))
    out[kind] = [[list(o.outputs[0].token_ids), [{str(t): e.logprob for t, e in lp.items()} for lp in o.outputs[0].logprobs]] for o in res]
Path(sys.argv[1]).write_text(json.dumps(out))
print("done", len(out))
