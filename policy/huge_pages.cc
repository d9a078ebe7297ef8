#include "policy/huge_pages.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Functions.h>

namespace vroll::policy {
namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;

}  // namespace

at::Tensor ZerosOnHugePages(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (bytes < kHugePageBytes) return at::zeros(sizes, dtype);
  const size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* memory = std::aligned_alloc(kHugePageBytes, rounded);
  if (memory == nullptr) throw std::bad_alloc();
  // Advice, not a requirement: without THP (or with THP "never") the pages are just small ones.
  (void)madvise(memory, rounded, MADV_HUGEPAGE);
  std::memset(memory, 0, bytes);  // first touch: faults in huge pages now, not during a step
  return at::from_blob(memory, sizes, [](void* p) { std::free(p); }, at::TensorOptions().dtype(dtype));
}

int64_t HugePageBytes(const at::Tensor& tensor) { return HugePageBytes(std::vector<at::Tensor>{tensor}); }

int64_t HugePageBytes(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (const at::Tensor& t : tensors) {
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    ranges.emplace_back(begin, begin + static_cast<uintptr_t>(t.nbytes()));
  }
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool overlaps = false;
  int64_t total_kib = 0;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      // Each mapping counts once, however many of the tensors it holds (the kernel merges
      // adjacent anonymous mappings with the same flags into one).
      overlaps = std::any_of(ranges.begin(), ranges.end(),
                             [&](const auto& r) { return lo < r.second && r.first < hi; });
      continue;
    }
    if (overlaps && line.rfind("AnonHugePages:", 0) == 0) {
      std::istringstream field(line.substr(14));
      int64_t kib = 0;
      if (field >> kib) total_kib += kib;
    }
  }
  return total_kib * 1024;
}

}  // namespace vroll::policy
