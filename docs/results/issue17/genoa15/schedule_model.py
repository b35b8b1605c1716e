"""A step-cost model of the offline ShareGPT-200 run (weights floor, per-row matmul, KV read,
prompt attention, host), to estimate what a longest-first schedule could save before running it
(longest_first.py). Calibrated on the thirteenth session's breakdown; it underestimates the run
(68 s against 72-75) and overestimated the gain (6%: the real runs gained nothing).
    .venv/bin/python schedule_model.py"""
import json, os, sys
rows=[json.loads(l) for l in open(os.path.expanduser('~/kvloom-peers/workloads/sharegpt200.jsonl'))]
P=[len(r['prompt_token_ids']) for r in rows]; O=[r['max_tokens'] for r in rows]
pair_cost = None
tot_pairs = sum(p*p/2 for p in P)
PAIR = 156*25/tot_pairs  # ms per causal (q,k) pair, calibrated to 156 ms/step avg
def sim(order, max_seqs=256, budget=2048, W=7.0, row=0.53, kvc=0.00068, host=0.8):
    waiting=list(order); running=[]  # [idx, computed_prompt, generated]
    t=0; steps=0
    while waiting or running:
        b=budget; rows_=0; ctx=0; patt=0
        for r in running:
            i=r[0]
            if r[1]<P[i]:
                n=min(P[i]-r[1], b)
                if n<=0: continue
                patt += n*(r[1]+n/2); r[1]+=n; b-=n; rows_+=n
                r.append('step')
            else:
                b-=1; rows_+=1; ctx+=P[i]+r[2]; r[2]+=1
        while waiting and b>0 and len(running)<max_seqs:
            i=waiting.pop(0); n=min(P[i], b); patt+=n*n/2; running.append([i,n,0]); b-=n; rows_+=n
        # a request whose prompt just completed yields its first token this step
        for r in running:
            if r[1]==P[r[0]] and r[2]==0: r[2]=1
        t += host + max(W, row*rows_) + kvc*ctx + PAIR*patt + 0.034*rows_
        steps+=1
        running=[r[:3] for r in running if r[2]<O[r[0]]]
    return t/1000, steps
fcfs=list(range(200))
lpt=sorted(fcfs, key=lambda i:-O[i])
print('fcfs 256', sim(fcfs))
for ms in (32,48,64,96,128,256):
    for bud in (256,512,2048):
        print('lpt', ms, bud, sim(lpt, max_seqs=ms, budget=bud))
