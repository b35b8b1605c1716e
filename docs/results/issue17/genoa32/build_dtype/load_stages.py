import resource, sys, os
from pathlib import Path
def rss():
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")): print("   ", line.strip())
import kvloom.models.registry as reg
orig_build, orig_load = reg.build_model, None
def build(*a, **k):
    m = orig_build(*a, **k); print("after build"); rss(); 
    ol = m.load_weights
    def lw(w):
        ol(w); print("after load_weights"); rss()
    m.load_weights = lw
    oto = m.to
    def to(*a2, **k2):
        r = oto(*a2, **k2); print("after to"); rss(); return r
    m.to = to
    op = m.pack_weights
    def pk(*a3, **k3):
        r = op(*a3, **k3); print("after pack"); rss(); return r
    m.pack_weights = pk
    return m
reg.build_model = build
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
e = LLMEngine(EngineConfig.from_kwargs("/tmp/ab_dtype/oss4", dtype="bfloat16", max_model_len=4096, num_blocks=64))
print("engine"); rss()
