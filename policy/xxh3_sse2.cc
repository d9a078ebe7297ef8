// XXH3 for baseline x86-64 (SSE2): see policy/xxh3.h.
#include <cstddef>
#define VROLL_XXH3_NS xxh3_sse2
#include "policy/xxh3_impl.inc"
