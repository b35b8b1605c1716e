import sys, time, torch; sys.path.insert(0,'tests'); sys.path.insert(0,'tests/structured')
import gguf
from helpers_models import default_model_path
from kvloom.tokenizer import Tokenizer
from kvloom.structured.compiler import GrammarCompiler
from kvloom.bench.structured import tagged_constraint, REVIEW_SCHEMA
from kvloom.runner.sampler import apply_token_bitmask
from kvloom.structured.mask import GrammarMask
import llguidance
tok = Tokenizer.from_gguf_metadata(gguf.GGUFReader(str(default_model_path())))
comp = GrammarCompiler(tok, 49152, [2])
g = comp.compile(tagged_constraint(REVIEW_SCHEMA))
ms = [g.new_matcher() for _ in range(16)]
for m in ms: m.consume_tokens(tok.encode("Hello there, this is", add_special_tokens=False))
ex = llguidance.LLExecutor()
W = (49152+31)//32
bm = torch.empty((16, W), dtype=torch.int32)
for rep in range(3):
    t=time.perf_counter()
    for _ in range(20): ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], bm.data_ptr(), W*4, 16)
    t1=time.perf_counter()
    logits = torch.randn(16, 49152)
    gm = GrammarMask(torch.arange(16), bm)
    for _ in range(20): apply_token_bitmask(logits, gm)
    t2=time.perf_counter()
    print(f"mask {1000*(t1-t)/20:.2f} ms/step(16 rows)  apply {1000*(t2-t1)/20:.2f} ms")
