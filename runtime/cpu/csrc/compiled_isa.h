// Shared by the CPU extensions: the instruction-set extensions a build was compiled for, named as in
// /proc/cpuinfo, so the loader can refuse a binary the running CPU cannot execute (the compiler may
// use any of them anywhere in the file).
#pragma once

#include <string>
#include <vector>

inline std::vector<std::string> compiled_isa() {
  std::vector<std::string> isa;
#ifdef __SSE4_2__
  isa.emplace_back("sse4_2");
#endif
#ifdef __AVX__
  isa.emplace_back("avx");
#endif
#ifdef __AVX2__
  isa.emplace_back("avx2");
#endif
#ifdef __FMA__
  isa.emplace_back("fma");
#endif
#ifdef __F16C__
  isa.emplace_back("f16c");
#endif
#ifdef __BMI2__
  isa.emplace_back("bmi2");
#endif
#ifdef __AVX512F__
  isa.emplace_back("avx512f");
#endif
#ifdef __AVX512DQ__
  isa.emplace_back("avx512dq");
#endif
#ifdef __AVX512BW__
  isa.emplace_back("avx512bw");
#endif
#ifdef __AVX512VL__
  isa.emplace_back("avx512vl");
#endif
#ifdef __AVX512CD__
  isa.emplace_back("avx512cd");
#endif
#ifdef __AVX512VNNI__
  isa.emplace_back("avx512_vnni");
#endif
#ifdef __AVX512BF16__
  isa.emplace_back("avx512_bf16");
#endif
#ifdef __AMX_TILE__
  isa.emplace_back("amx_tile");
#endif
#ifdef __AMX_BF16__
  isa.emplace_back("amx_bf16");
#endif
  return isa;
}
