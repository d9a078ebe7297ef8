// XXH3 built with -mavx512f (policy/CMakeLists.txt): see policy/xxh3.h. Called only where the CPU
// has AVX-512F.
#include <cstddef>
#define VROLL_XXH3_NS xxh3_avx512
#include "policy/xxh3_impl.inc"
