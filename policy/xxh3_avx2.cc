// XXH3 built with -mavx2 (policy/CMakeLists.txt): see policy/xxh3.h. Called only where the CPU
// has AVX2.
#include <cstddef>
#define VROLL_XXH3_NS xxh3_avx2
#include "policy/xxh3_impl.inc"
