#include "transport/curve.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <zmq.h>

#include "policy/logging.h"

namespace vroll::transport {

namespace {

/// The key a line holds: its first whitespace-separated token, or "" for a blank line or a
/// comment. Z85 uses '#' itself, so a comment is a line whose first token starts with '#' and is
/// not a key; text after the key is a comment too ("KEY  # trainer-0").
std::string KeyOfLine(const std::string& line) {
  const size_t begin = line.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return {};
  const size_t end = line.find_first_of(" \t\r\n", begin);
  std::string token = line.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  if (token[0] == '#' && !IsZ85Key(token)) return {};
  return token;
}

std::vector<std::string> ReadKeys(const std::string& path, bool single) {
  std::ifstream in(path);
  if (!in) throw TransportError(fmt::format("{}: cannot read CURVE key file ({})", path, std::strerror(errno)));
  std::vector<std::string> keys;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    const std::string key = KeyOfLine(line);
    if (key.empty()) continue;
    if (!IsZ85Key(key)) {
      throw TransportError(fmt::format("{}:{}: not a 40-character Z85 CURVE key", path, line_no));
    }
    keys.push_back(key);
    if (single) break;
  }
  return keys;
}

}  // namespace

CurveKeyPair GenerateCurveKeyPair() {
  char public_key[41] = {};
  char secret_key[41] = {};
  if (zmq_curve_keypair(public_key, secret_key) != 0) {
    throw TransportError(fmt::format("zmq_curve_keypair failed: {} (libzmq built without CURVE?)", zmq_strerror(zmq_errno())));
  }
  return {public_key, secret_key};
}

std::string CurvePublicKey(const std::string& secret_key, const std::string& what) {
  CheckZ85Key(secret_key, what);
  char public_key[41] = {};
  if (zmq_curve_public(public_key, secret_key.c_str()) != 0) {
    throw TransportError(fmt::format("{}: zmq_curve_public failed: {}", what, zmq_strerror(zmq_errno())));
  }
  return public_key;
}

bool IsZ85Key(const std::string& key) {
  if (key.size() != 40) return false;
  uint8_t bytes[32];
  return zmq_z85_decode(bytes, key.c_str()) != nullptr;
}

void CheckZ85Key(const std::string& key, const std::string& what) {
  if (!IsZ85Key(key)) {
    throw TransportError(fmt::format("{} must be a 40-character Z85 CURVE key (got {} characters)", what, key.size()));
  }
}

std::string ReadCurveKeyFile(const std::string& path) {
  std::vector<std::string> keys = ReadKeys(path, /*single=*/true);
  if (keys.empty()) throw TransportError(fmt::format("{}: holds no CURVE key", path));
  return keys[0];
}

namespace {
bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

std::string ReadCurveSecretKeyFile(const std::string& path) {
  if (EndsWith(path, ".pub")) {
    throw TransportError(fmt::format("{}: a .pub file holds a public key (vroll-keygen NAME writes the secret one to "
                                     "NAME.key); a secret key is needed here",
                                     path));
  }
  const std::string secret = ReadCurveKeyFile(path);
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    vroll::Logger("transport").warn("{}: this secret key file is open to group or others (mode {:04o}): chmod 600 it",
                             path, st.st_mode & 07777);
  }
  if (EndsWith(path, ".key")) {
    const std::string public_path = path.substr(0, path.size() - 4) + ".pub";
    if (::access(public_path.c_str(), R_OK) == 0) {
      const std::string expected = CurvePublicKey(secret, path);
      if (ReadCurveKeyFile(public_path) != expected) {
        throw TransportError(fmt::format("{}: its public key is {}, but {} beside it holds another pair's public key: "
                                         "clients given that one would never connect",
                                         path, expected, public_path));
      }
    }
  }
  return secret;
}

std::vector<std::string> ReadCurveKeyListFile(const std::string& path) {
  if (EndsWith(path, ".key")) {
    throw TransportError(fmt::format("{}: a .key file holds a secret key (vroll-keygen NAME writes the public one to "
                                     "NAME.pub); an allow-list lists public keys, one per line",
                                     path));
  }
  return ReadKeys(path, /*single=*/false);
}

void WriteCurveKeyFile(const std::string& path, const std::string& key, bool secret) {
  // Written to a new file beside `path` (mkstemp: mode 0600, never an existing file or a link),
  // then renamed over it: a secret key is never readable by others, not even while an existing
  // world-readable file is overwritten, and a failure leaves the old file as it was.
  std::string tmp = path + ".XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) throw TransportError(fmt::format("{}: cannot write ({})", path, std::strerror(errno)));
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw TransportError(fmt::format("{}: {} ({})", path, what, std::strerror(err)));
  };
  if (!secret && ::fchmod(fd, 0644) != 0) fail("cannot set mode 0644");
  const std::string text = key + "\n";
  if (::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) fail("write failed");
  if (::fsync(fd) != 0) fail("write failed");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw TransportError(fmt::format("{}: write failed ({})", path, std::strerror(err)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw TransportError(fmt::format("{}: cannot write ({})", path, std::strerror(err)));
  }
}

}  // namespace vroll::transport
