"""Instrument a tree's gemm.cpp (run_vector) to report how far apart its two threads finish
each call: rdtsc at the call's start and at each thread's end, summed by rows (m <= 16,
<= 128, more) and printed at exit. A measuring patch, never committed: apply it to a
worktree (or the working tree, then `git checkout kvloom/csrc/gemm.cpp`), and run
engine steps, e.g.

    python docs/results/issue17/gemm_imbalance_patch.py /tmp/wt
    cd /tmp/wt && /work/main/.venv/bin/python -m kvloom bench steps --batches 16 --context 300 --decode-steps 60 --repeats 1

"gap" is the sum over calls of |end of thread 0 - end of thread 1|: the time one
thread waited at the closing barrier.
"""
import sys
p=sys.argv[1]+'/kvloom/csrc/gemm.cpp'
s=open(p).read()
stats='''struct ImbalanceStats { uint64_t n[3] = {}, total[3] = {}, gap[3] = {};
  ~ImbalanceStats() { const char* nm[3] = {"m<=16", "m<=128", "m>128"};
    for (int i = 0; i < 3; ++i) if (n[i]) fprintf(stderr, "GEMM %s calls %lu total %.1f Mcyc (%.1f kcyc/call) gap %.1f Mcyc (%.1f%%)\\n", nm[i], n[i], total[i]/1e6, total[i]/1e3/n[i], gap[i]/1e6, 100.0*gap[i]/total[i]); } };
static ImbalanceStats imb;
inline void imbalance_record(int64_t m, uint64_t b, uint64_t d0, uint64_t d1) {
  const int i = m <= 16 ? 0 : m <= 128 ? 1 : 2; const uint64_t e = std::max(d0, d1);
  imb.n[i]++; imb.total[i] += e - b; imb.gap[i] += (d0 > d1 ? d0 - d1 : d1 - d0); }
template <class Path>
void run_vector('''
s=s.replace('template <class Path>\nvoid run_vector(',stats,1)
s='#include <x86intrin.h>\n#include <cstdio>\n'+s
a='#pragma omp parallel num_threads(threads)\n  {\n'
i=s.index('void run_vector(')
j=s.index(a,i)
s=s[:j]+'  uint64_t t_begin = __rdtsc(); uint64_t t_done[2] = {0, 0};\n'+a+'    struct Done { uint64_t* at; ~Done() { *at = __rdtsc(); } } done{&t_done[omp_get_thread_num() & 1]};\n'+s[j+len(a):]
k=s.index('// ---- AVX2')
end=s.rindex('\n}\n',0,k)
s=s[:end]+'\n  if (threads == 2) imbalance_record(p.m, t_begin, t_done[0], t_done[1]);\n}\n'+s[end+3:]
open(p,'w').write(s)
