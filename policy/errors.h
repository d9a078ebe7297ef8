#pragma once
// Exception types thrown at the policy layer's API edges. Messages always name the file (or
// source) and the field that was wrong, e.g. "stories.bin: header field n_heads = 0 must be > 0".

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

}  // namespace vroll::policy
