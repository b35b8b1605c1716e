#include <omp.h>
#include <chrono>
#include <cstdio>
#include <atomic>
int main(){
  std::atomic<long> sink{0};
  for (int rep=0; rep<5; ++rep){
    auto t0=std::chrono::steady_clock::now();
    for(int i=0;i<20000;i++){
      #pragma omp parallel num_threads(2)
      { sink.fetch_add(omp_get_thread_num(), std::memory_order_relaxed); }
    }
    auto t1=std::chrono::steady_clock::now();
    #pragma omp parallel num_threads(2)
    {
      for(int i=0;i<20000;i++){
        #pragma omp barrier
      }
    }
    auto t2=std::chrono::steady_clock::now();
    printf("fork/join %.2f us   barrier %.2f us\n", std::chrono::duration<double,std::micro>(t1-t0).count()/20000, std::chrono::duration<double,std::micro>(t2-t1).count()/20000);
  }
}
