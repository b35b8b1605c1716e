"""The prompt attention's softmax, what its parts cost: builds of paged_attention.cpp with a part
taken out (each wrong in its output, for timing only), timed against this checkout's build by
docs/results/issue17/attention_ab.py (in one process, alternating).

    .venv/bin/python docs/results/issue17/genoa14/softmax_variants.py VARIANT OUT_DIR
    SHAPES="8x256x256,2x1000x1000" .venv/bin/python docs/results/issue17/attention_ab.py OUT_DIR/csrc 8

VARIANT: noexp (the probabilities' exp16 left out), nomax (no running max: new_max = 0, no
rescale), nosoft (no max, no rescale, no exp), vexp (the rescale's factor by exp16 instead of
std::exp: a different rounding), count (counters of the max's updates and changes, printed at
exit; for the engine's real prompts copy it into a worktree: git worktree add /tmp/wt HEAD,
cp OUT_DIR/csrc/paged_attention.cpp /tmp/wt/kvloom/csrc/, then
PYTHONPATH=/tmp/wt .venv/bin/python docs/results/issue17/genoa14/max_changes_run.py 8).
"""
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).parents[4]
variant, out = sys.argv[1], Path(sys.argv[2])
shutil.rmtree(out, ignore_errors=True)
shutil.copytree(REPO / "kvloom/csrc", out / "csrc")
path = out / "csrc/paged_attention.cpp"
text = path.read_text()
rescale = "        if (new_max != row_max[g]) {  // rescale what was accumulated under the old max\n"
if variant == "noexp":
    text = text.replace("e = _mm512_maskz_mov_ps(live, kvloom_simd::exp16(_mm512_sub_ps(scaled, _mm512_set1_ps(new_max))));",
                        "e = _mm512_maskz_mov_ps(live, _mm512_sub_ps(scaled, _mm512_set1_ps(new_max)));")
elif variant == "nomax":
    i = text.index("        const float new_max = running_max(row_max[g], scaled, live);\n" + rescale)
    j = text.index("        e = _mm512_maskz_mov_ps(live, kvloom_simd::exp16", i)
    text = text[:i] + "        const float new_max = 0.0f;\n" + text[j:]
elif variant == "nosoft":
    i = text.index("      if (live) {\n        const __m512 scaled")
    j = text.index("      Pairs::probabilities(e, weights[g]);", i)
    text = text[:i] + "      e = _mm512_maskz_mul_ps(live, sc[g], scale_v);\n" + text[j:]
elif variant == "vexp":
    text = text.replace("          const __m512 correction = _mm512_set1_ps(std::exp(row_max[g] - new_max));\n"
                        "          for (int r = 0; r < R; ++r) acc[g][r]",
                        "          const __m512 correction = kvloom_simd::exp16(_mm512_set1_ps(row_max[g] - new_max));\n"
                        "          for (int r = 0; r < R; ++r) acc[g][r]", 1)
elif variant == "count":
    text = text.replace(rescale, "        __atomic_add_fetch(&kvloom_updates, 1, __ATOMIC_RELAXED);\n" + rescale
                        + "        __atomic_add_fetch(&kvloom_changes, 1, __ATOMIC_RELAXED);\n", 1)
    marker = "// ---------------------------------------------------------------------------------\n// Paired layout (paired.h)"
    text = text.replace(marker, "}  // namespace\n#include <cstdio>\nlong kvloom_updates = 0, kvloom_changes = 0;\n"
                        "struct Report { ~Report() { fprintf(stderr, \"updates %ld changes %ld ratio %.3f\\n\", "
                        "kvloom_updates, kvloom_changes, (double)kvloom_changes / (kvloom_updates + 1)); } } report;\n"
                        "namespace {\n" + marker, 1)
else:
    sys.exit(f"unknown variant {variant}")
assert text != path.read_text(), "the source moved: the variant's anchor no longer matches"
path.write_text(text)
print(out / "csrc")
