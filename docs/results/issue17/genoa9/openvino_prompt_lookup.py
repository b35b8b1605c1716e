"""shared/peers/openvino_bench.py with OpenVINO GenAI's prompt lookup decoding on: the
n-gram speculation that matches kvloom's `{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}` (up to 4 candidate tokens a step, from the longest n-gram of up
to 4 tokens matching the request's own tokens). Same arguments as openvino_bench.py, run
with the OpenVINO venv's python:

    ~/kvloom-peers/ov-venv/bin/python docs/results/issue17/genoa9/openvino_prompt_lookup.py \
        --workload ~/kvloom-peers/workloads/sharegpt200.jsonl --out ov_ngram.json
"""
import os
import sys

sys.path.insert(0, os.environ.get("PEERS_SCRIPTS", "/work/shared/peers"))
import openvino_bench as bench  # noqa: E402

NUM_ASSISTANT_TOKENS = int(os.environ.get("NUM_ASSISTANT_TOKENS", "4"))
MAX_NGRAM_SIZE = int(os.environ.get("MAX_NGRAM_SIZE", "4"))

plain_properties, plain_config = bench.ov_properties, bench.gen_config


def ov_properties(a):
    return {**plain_properties(a), "prompt_lookup": True}


def gen_config(n, ignore_eos=True, min_new=False):
    config = plain_config(n, ignore_eos, min_new)
    config.num_assistant_tokens = NUM_ASSISTANT_TOKENS
    config.max_ngram_size = MAX_NGRAM_SIZE
    return config


bench.ov_properties, bench.gen_config = ov_properties, gen_config
if __name__ == "__main__":
    bench.main()
