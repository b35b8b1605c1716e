// Where a decode step's KV read could go without the arithmetic: 30 layers of blocks read
// by 2 threads per sequence, one kv head at a time (mode 0), all heads of a block at once
// (1), or from per-head pools (2); random or sequential block order (last argument).
// g++ -O3 -march=native -fopenmp kv_read_patterns.cpp -o kv_read && ./kv_read 64 320 MODE 16 SEQ
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <chrono>
#include <omp.h>
#include <sys/mman.h>
#include <algorithm>
// modes: 0 per-head walk (K,V separate pools, heads interleaved in block)
//        1 all heads per block
//        2 per-head walk, head-major pools (head h's chunk of block b at [h][b])
int main(int argc,char**argv){
  int B=atoi(argv[1]), ctx=atoi(argv[2]); int mode=atoi(argv[3]); int bt=atoi(argv[4]); int seq=atoi(argv[5]);
  const int L=30,H=3; int HB=bt*128; int NB=2048*16/bt;
  size_t bytes=(size_t)L*NB*H*HB;
  char* K=(char*)aligned_alloc(1<<21,bytes); char* V=(char*)aligned_alloc(1<<21,bytes);
  madvise(K,bytes,MADV_HUGEPAGE); madvise(V,bytes,MADV_HUGEPAGE);
  for(size_t i=0;i<bytes;i+=64){K[i]=1;V[i]=2;}
  int nb=(ctx+bt-1)/bt; std::vector<int> perm(NB); for(int i=0;i<NB;i++)perm[i]=i;
  std::mt19937 g(1); if(!seq) std::shuffle(perm.begin(),perm.end(),g);
  std::vector<int> tab(B*nb); for(int i=0;i<B*nb;i++) tab[i]=perm[i%NB];
  double best=1e9; float sink=0;
  for(int rep=0;rep<9;rep++){
    auto t0=std::chrono::steady_clock::now();
    for(int l=0;l<L;l++){
      char* Kl=K+(size_t)l*NB*H*HB; char* Vl=V+(size_t)l*NB*H*HB;
      #pragma omp parallel for schedule(dynamic,1) num_threads(2) reduction(+:sink)
      for(int s=0;s<B;s++){
        __m512 acc=_mm512_setzero_ps();
        auto chunk=[&](const char* kb,const char* vb,int n){for(int o=0;o<n;o+=64){acc=_mm512_add_ps(acc,_mm512_load_ps((const float*)(kb+o)));acc=_mm512_add_ps(acc,_mm512_load_ps((const float*)(vb+o)));}};
        if(mode==0){ for(int h=0;h<H;h++) for(int b=0;b<nb;b++){size_t at=((size_t)tab[s*nb+b]*H+h)*HB; chunk(Kl+at,Vl+at,HB);} }
        else if(mode==1){ for(int b=0;b<nb;b++){size_t at=((size_t)tab[s*nb+b]*H)*HB; chunk(Kl+at,Vl+at,H*HB);} }
        else { for(int h=0;h<H;h++) for(int b=0;b<nb;b++){size_t at=((size_t)h*NB+tab[s*nb+b])*HB; chunk(Kl+at,Vl+at,HB);} }
        sink+=_mm512_reduce_add_ps(acc);
      }
    }
    double dt=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
    best=std::min(best,dt);
  }
  double kv=(double)L*B*nb*H*HB*2;
  printf("B=%d ctx=%d mode=%d bt=%d seq=%d: %.2f ms  %.1f GB/s\n",B,ctx,mode,bt,seq,best*1e3,kv/best/1e9);
}
