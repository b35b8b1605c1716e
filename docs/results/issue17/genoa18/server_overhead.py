"""The server's own cost per token: a tiny float32 model (steps of well under a millisecond),
one streamed request of 1,000 tokens, four times, in-process; run from a checkout's directory
to time that checkout (it imports the kvloom it finds there first)."""
import sys, time, tempfile, os
sys.path.insert(0, os.getcwd())
sys.path.insert(1, "/work/main/tests"); sys.path.insert(1, "/work/main/tests/server")
from pathlib import Path
import httpx
import kvloom
from helpers_models import write_tiny_hf_model
from server_harness import start_live_server
from kvloom.server.settings import ServerSettings
path = write_tiny_hf_model(Path(tempfile.mkdtemp()), arch="llama", max_position_embeddings=2048)
live = start_live_server(path, ServerSettings(served_model_name="tiny"), max_model_len=2048, num_blocks=256)
with httpx.Client(base_url=live.base_url, timeout=120) as http:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True, "temperature": 0}
    times = []
    for _ in range(4):
        start = time.perf_counter()
        with http.stream("POST", "/v1/completions", json=body) as r:
            n = sum(1 for line in r.iter_lines() if line.startswith("data: {"))
        times.append(time.perf_counter() - start)
live.stop()
print(kvloom.__file__, " ".join(f"{t / 1000 * 1e3:.3f}" for t in times), "ms/token")
