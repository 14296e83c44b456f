// The instruction-set paths of the CPU backend: every file of src/cpu but dispatch.cpp is compiled
// once per path (CMakeLists.txt, emflow_add_cpu_paths), and dispatch.cpp picks one path per process
// from what the processor has.
//
// A path's compilation defines
//   EMFLOW_CPU_TARGET  its name (avx2, avx512, avx512bf16; generic off x86-64), the namespace
//                      its code lives in: emflow::detail::cpu::<name>
//   EMFLOW_CPU_LEVEL   what its code may use: 1 AVX2 and FMA, 2 AVX-512 (F, CD, DQ, BW, VL),
//                      3 AVX-512 and AVX512-BF16; 0 the target's own vectors
//   EMFLOW_CPU_ISA     the target of its functions, as a GCC/Clang target string
// and nothing else changes: the files are compiled for the library's baseline target, and
// EMFLOW_CPU_BEGIN applies the path's target to the functions written after it only. The
// headers of the standard library and of the rest of emflow are read before it, so their inline
// functions and templates keep the baseline target wherever the path's code instantiates them:
// were a whole file compiled with -mavx512f, the linker could keep its copy of, say,
// std::vector<float>::resize for every caller, and a processor without AVX-512 would stop on an
// illegal instruction in code that never meant to use it.
//
// Every file (and every header of src/cpu with code) therefore includes what it needs first and
// then writes its code between EMFLOW_CPU_BEGIN and EMFLOW_CPU_END, which open and close the
// path's namespace; the shared types of engine.hpp, sdpa.hpp and layer_backward.hpp stay in
// emflow::detail::cpu. Outside a path's compilation (dispatch.cpp, and the rest of the library
// reading those headers) EMFLOW_CPU_BEGIN opens emflow::detail::cpu itself, where dispatch.cpp
// defines each function of a path as a call through the chosen path's table (kernels.hpp).
#pragma once

#define EMFLOW_CPU_DO_PRAGMA(text) _Pragma(#text)
#define EMFLOW_CPU_PRAGMA(text) EMFLOW_CPU_DO_PRAGMA(text)

#if defined(EMFLOW_CPU_TARGET)
#if !defined(EMFLOW_CPU_LEVEL) || !defined(EMFLOW_CPU_ISA)
#error "a CPU path's compilation defines EMFLOW_CPU_TARGET, EMFLOW_CPU_LEVEL and EMFLOW_CPU_ISA"
#endif
#if EMFLOW_CPU_LEVEL == 0
#define EMFLOW_CPU_TARGET_PUSH
#define EMFLOW_CPU_TARGET_POP
#elif defined(__clang__)
// (A region of declarations only, such as kernels.cpp's table, is no mistake.)
#define EMFLOW_CPU_TARGET_PUSH                                                            \
  _Pragma("clang diagnostic push")                                                        \
      _Pragma("clang diagnostic ignored \"-Wpragma-clang-attribute\"") EMFLOW_CPU_PRAGMA( \
          clang attribute push(__attribute__((target(EMFLOW_CPU_ISA))), apply_to = function))
#define EMFLOW_CPU_TARGET_POP _Pragma("clang attribute pop") _Pragma("clang diagnostic pop")
#else
#define EMFLOW_CPU_TARGET_PUSH \
  _Pragma("GCC push_options") EMFLOW_CPU_PRAGMA(GCC target(EMFLOW_CPU_ISA))
#define EMFLOW_CPU_TARGET_POP _Pragma("GCC pop_options")
#endif
/// Opens the path's namespace with its target applied to every function until EMFLOW_CPU_END.
#define EMFLOW_CPU_BEGIN EMFLOW_CPU_TARGET_PUSH namespace emflow::detail::cpu::EMFLOW_CPU_TARGET {
#define EMFLOW_CPU_END \
  }                    \
  EMFLOW_CPU_TARGET_POP
#else
#define EMFLOW_CPU_LEVEL (-1)
#define EMFLOW_CPU_BEGIN namespace emflow::detail::cpu {
#define EMFLOW_CPU_END }
#endif

/// What the path's code may use (the target's macros, __AVX512F__ and the like, describe the
/// baseline, not the path).
#define EMFLOW_CPU_AVX2 (EMFLOW_CPU_LEVEL >= 1)
#define EMFLOW_CPU_AVX512 (EMFLOW_CPU_LEVEL >= 2)
#define EMFLOW_CPU_AVX512BF16 (EMFLOW_CPU_LEVEL >= 3)
