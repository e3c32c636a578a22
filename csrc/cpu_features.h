// Run-time CPU feature checks for the kernels that choose a vector path: compiled with
// target attributes and picked here, so the module still loads (and gives the same bits
// through the portable loops) on CPUs without the instructions.
#pragma once

namespace fusionring {
namespace cpu {

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
// AVX with F16C: the fp16 <-> fp32 conversions of the reductions (csrc/reduce.cc).
inline bool has_f16c() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx") &&
                                                     __builtin_cpu_supports("f16c"));
  return has;
}

// AVX2 with POPCNT and F16C: the N:M kernels' 256-bit path (csrc/nm_sparse.cc).
inline bool has_avx2() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") &&
                                                     __builtin_cpu_supports("popcnt") &&
                                                     __builtin_cpu_supports("f16c"));
  return has;
}

// AVX-512 F/BW/VL/DQ: the N:M kernels' 512-bit path.
inline bool has_avx512() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") &&
                                                     __builtin_cpu_supports("avx512bw") &&
                                                     __builtin_cpu_supports("avx512vl") &&
                                                     __builtin_cpu_supports("avx512dq"));
  return has;
}
#else
inline bool has_f16c() { return false; }
inline bool has_avx2() { return false; }
inline bool has_avx512() { return false; }
#endif

// 0: portable loops, 1: AVX2, 2: AVX-512 (which needs the AVX2 set as well).
inline int vector_level() {
  if (!has_avx2()) return 0;
  return has_avx512() ? 2 : 1;
}

}  // namespace cpu
}  // namespace fusionring
