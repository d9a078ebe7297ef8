#pragma once
// CLI11 checks for the example programs' numeric options, with messages that say what is
// expected: CLI11's own PositiveNumber answers 0 with "Value 0 not in range 0.000000 to
// 1.797693e+308", and a plain int option takes -3 threads silently.

#include <cmath>
#include <string>

#include <fmt/format.h>

#include <CLI/CLI.hpp>

namespace vroll::examples {

/// Accepts a decimal integer >= `min`; otherwise "must be an integer >= MIN (got 'VALUE')".
inline CLI::Validator IntAtLeast(long long min) {
  return CLI::Validator(
      [min](std::string& value) -> std::string {
        try {
          size_t end = 0;
          const long long v = std::stoll(value, &end);
          if (end == value.size() && v >= min) return "";
        } catch (const std::exception&) {
        }
        return "must be an integer >= " + std::to_string(min) + " (got '" + value + "')";
      },
      "INT>=" + std::to_string(min));
}

/// Accepts a finite decimal number >= `min`; otherwise "must be a number >= MIN (got 'VALUE')"
/// (CLI11's NonNegativeNumber prints the upper bound, DBL_MAX, in full).
inline CLI::Validator NumberAtLeast(double min) {
  return CLI::Validator(
      [min](std::string& value) -> std::string {
        try {
          size_t end = 0;
          const double v = std::stod(value, &end);
          if (end == value.size() && std::isfinite(v) && v >= min) return "";
        } catch (const std::exception&) {
        }
        return "must be a number >= " + fmt::format("{}", min) + " (got '" + value + "')";
      },
      "NUMBER>=" + fmt::format("{}", min));
}

}  // namespace vroll::examples
