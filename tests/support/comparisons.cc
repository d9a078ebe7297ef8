#include "tests/support/comparisons.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <ATen/ATen.h>

namespace vroll::testing {

double MaxRelDiff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max()).item<double>();
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]));
  return m;
}

bool BitEqual(const policy::WeightMap& a, const policy::WeightMap& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    const auto it = b.find(name);
    if (it == b.end() || it->second.shape != t.shape || it->second.data.size() != t.data.size()) return false;
    if (std::memcmp(t.data.data(), it->second.data.data(), t.data.size() * sizeof(float)) != 0) return false;
  }
  return true;
}

}  // namespace vroll::testing
