#pragma once
// Distances between results, for the tolerances the suites assert (the thresholds stay in the
// tests: each one says what it allows).

#include <vector>

#include "policy/weights.h"

namespace at {
class Tensor;  // <ATen/core/Tensor.h>; forward-declared so that tensor-free suites stay light
}  // namespace at

namespace vroll::testing {

/// max|a - b| / max|b| over all elements: the largest error relative to the largest magnitude
/// of the reference `b`, so a scaled model is held to the same figure. `a` and `b` broadcast
/// (in practice: the same shape, e.g. logits [tokens, vocab]). Not symmetric: `b` is the
/// reference. Infinite or NaN when `b` is all zeros.
double MaxRelDiff(const at::Tensor& a, const at::Tensor& b);

/// max_i |a[i] - b[i]| for i in [0, a.size()), in double; 0 for an empty `a`.
/// Precondition: b.size() >= a.size() (e.g. logprobs of the same output tokens).
double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b);

/// True when both maps hold the same names, shapes and bit patterns (memcmp, so NaN-safe and
/// -0.0 != 0.0).
bool BitEqual(const policy::WeightMap& a, const policy::WeightMap& b);

}  // namespace vroll::testing
