#pragma once
// Model text on a terminal, and whether stdout took what the programs wrote.

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace vroll::examples {

/// `piece` as llama2.c's run.c prints it (safe_printf), a little stricter: a piece of one byte
/// that is neither printable nor a space, tab or newline (a raw byte token: a control character
/// such as ESC, BEL or CR, or one byte of a multi-byte UTF-8 character) is left out, so that
/// model output cannot send control sequences to the terminal or overwrite its lines. (run.c
/// keeps every isspace byte: CR, VT and FF too.) Other pieces are returned as they are.
inline std::string SafePiece(const std::string& piece) {
  if (piece.size() == 1) {
    const unsigned char c = static_cast<unsigned char>(piece[0]);
    if (!(std::isprint(c) || c == ' ' || c == '\t' || c == '\n')) return "";
  }
  return piece;
}

/// `text` with its control bytes (below 0x20 but tab and newline, and 0x7f) left out: user input
/// such as a prompt echoed to the terminal. UTF-8 multi-byte characters are kept.
inline std::string SafeText(const std::string& text) {
  std::string out;
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if ((c >= 0x20 && c != 0x7f) || c == '\t' || c == '\n') out += ch;
  }
  return out;
}

/// Flushes stdout. Returns an empty string when everything written to it went out, else why not
/// (e.g. "No space left on device" for >/dev/full): a program whose output was lost must not exit 0.
inline std::string StdoutError() {
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    return std::string("writing the output to stdout failed: ") + (errno != 0 ? std::strerror(errno) : "I/O error");
  }
  return "";
}

}  // namespace vroll::examples
