"""How tight an int8 screen of the greedy head would be (notes.txt section 2): transformers' final
hidden states over 12 ShareGPT prompts, int8 logits with per-token and per-row scales, a proven
bound on their error, and how many tokens (and 16-column blocks) could still hold the argmax.
    .venv/bin/python docs/results/issue17/genoa14/screen_feas.py"""
import json, torch, time
from transformers import AutoModelForCausalLM
t=time.time()
m = AutoModelForCausalLM.from_pretrained('/root/kvloom-peers/models', gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf', torch_dtype=torch.bfloat16)
print('load', time.time()-t)
E = m.lm_head.weight.detach().float()  # [V, K] bf16 values
V, K = E.shape
sv = E.abs().amax(1) / 127
Eq = torch.round(E / sv[:, None])
E1 = E.abs().sum(1)
rows = [json.loads(l) for l in open('/root/kvloom-peers/workloads/sharegpt200.jsonl')][:12]
tot = []; blocks=[]
for r in rows:
    ids = torch.tensor([r['prompt_token_ids'][:300]])
    with torch.no_grad():
        out = m(ids, output_hidden_states=True)
    h = out.hidden_states[-1][0].float()  # [T, K]
    exact = h @ E.T
    sh = h.abs().amax(1) / 127
    hq = torch.round(h / sh[:, None])
    approx = (hq @ Eq.T) * sh[:, None] * sv[None, :]
    eps = sv[None, :] / 2 * h.abs().sum(1, keepdim=True) + sh[:, None] / 2 * E1[None, :] + K * sh[:, None] * sv[None, :] / 4
    lo = (approx - eps).amax(1, keepdim=True)
    cand = (approx + eps) >= lo
    assert bool((cand.gather(1, exact.argmax(1, keepdim=True))).all())
    tot.append(cand.sum(1).float()); 
    blocks.append(cand.view(cand.shape[0], -1, 16).any(2).sum(1).float())
    print(r['max_tokens'], 'cands median %.0f mean %.0f max %.0f; blocks mean %.0f; eps mean %.3f; h1 %.1f hmax %.2f' % (tot[-1].median(), tot[-1].mean(), tot[-1].max(), blocks[-1].mean(), eps.mean(), h.abs().sum(1).mean(), h.abs().amax(1).mean()))
a = torch.cat(tot); b = torch.cat(blocks)
print('all: cands mean', a.mean().item(), 'p90', a.quantile(.9).item(), 'blocks mean', b.mean().item(), 'of', V // 16)
