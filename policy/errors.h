#pragma once
// Exception types thrown at the policy layer's API edges. Messages always name the file (or
// source) and the field that was wrong, e.g. "stories.bin: header field n_heads = 0 must be > 0".

#include <exception>
#include <stdexcept>
#include <string>

namespace vroll::policy {

/// A checkpoint, tokenizer or config could not be loaded: truncated, inconsistent or malformed.
class LoadError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A configuration struct failed Validate(): the message names the field.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// The message to show a user for `e`: what() for our exceptions; for LibTorch's c10::Error
/// (e.g. a failed allocation, a missing device backend) its first line without the C++
/// backtrace LibTorch appends. Thread safety: reentrant.
std::string DescribeError(const std::exception& e);

}  // namespace vroll::policy
