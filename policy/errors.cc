#include "policy/errors.h"

#include <c10/util/Exception.h>

namespace vroll::policy {

std::string DescribeError(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    const std::string message = c10_error->what_without_backtrace();
    return message.substr(0, message.find('\n'));
  }
  return e.what();
}

}  // namespace vroll::policy
