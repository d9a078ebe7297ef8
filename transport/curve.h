#pragma once
// ZeroMQ CURVE keys for vroll: Z85 text (40 characters for a 32-byte key), as zmq_curve_keypair
// makes them. Key files hold one key per line: the line's first whitespace-separated token;
// anything after it is a comment, and so is a line whose first token starts with '#' and is not
// a key (Z85 itself uses '#'). See docs/PROTOCOL.md, "Security".

#include <stdexcept>
#include <string>
#include <vector>

namespace vroll::transport {

/// A failure at the transport's API edge: a bad endpoint or key, a socket that cannot bind or
/// connect, a reply that did not come in time. The message names the endpoint, file or key.
class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A CURVE key pair, Z85 text.
struct CurveKeyPair {
  std::string public_key;
  std::string secret_key;
};

/// A fresh key pair (zmq_curve_keypair). Throws TransportError when libzmq lacks CURVE.
CurveKeyPair GenerateCurveKeyPair();

/// The public key of a Z85 secret key (zmq_curve_public). Throws TransportError naming `what`
/// when `secret_key` is not a valid Z85 key.
std::string CurvePublicKey(const std::string& secret_key, const std::string& what = "secret key");

/// True when `key` is 40 characters of Z85 that decode to 32 bytes.
bool IsZ85Key(const std::string& key);

/// Throws TransportError "<what> must be a 40-character Z85 CURVE key" unless IsZ85Key(key).
void CheckZ85Key(const std::string& key, const std::string& what);

/// Reads the first key of a key file (`vroll-keygen` writes NAME.key and NAME.pub). Throws
/// TransportError naming the file when it cannot be read or holds no valid key.
std::string ReadCurveKeyFile(const std::string& path);

/// ReadCurveKeyFile for a secret key, refusing the mix-ups that would otherwise only show as
/// clients timing out: a path ending in ".pub" (vroll-keygen's public half), and a NAME.key whose
/// NAME.pub beside it holds the public key of another pair. Throws TransportError naming both.
/// Logs a warning when the file is readable by its group or others.
std::string ReadCurveSecretKeyFile(const std::string& path);

/// Reads an allow-list file: one Z85 public key per line; blank and comment lines are skipped,
/// and a line may carry a comment after the key ("KEY  # trainer-0"). Throws TransportError
/// naming the file and line of the first invalid key, or the file when its name ends in ".key"
/// (vroll-keygen's secret key file: an allow-list lists public keys).
std::vector<std::string> ReadCurveKeyListFile(const std::string& path);

/// Writes `key` and a newline to `path`, mode 0600 when `secret` (also when it replaces a file
/// with a wider mode), else 0644: into a new file beside it, renamed over `path`, so the key is
/// never readable by others and a failure leaves an existing file unchanged. Throws
/// TransportError.
void WriteCurveKeyFile(const std::string& path, const std::string& key, bool secret);

}  // namespace vroll::transport
