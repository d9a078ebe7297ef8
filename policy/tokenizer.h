#pragma once
// llama2.c / SentencePiece-style BPE tokenizer (format: llama2.c tokenizer.py export, run.c
// build_tokenizer; see ../shared/models/SOURCES.md) and a byte-level tokenizer for the embedded
// default model.

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace vroll::policy {

using TokenId = int32_t;

/// Immutable after construction; const methods are safe to call from many threads.
class Tokenizer {
 public:
  static constexpr TokenId kUnk = 0;
  static constexpr TokenId kBos = 1;
  static constexpr TokenId kEos = 2;

  /// Loads a llama2.c tokenizer.bin holding (at least) `vocab_size` entries:
  ///   uint32 max_token_length, then per token: float32 score, int32 len, len bytes.
  /// Only the first `vocab_size` entries are read (as run.c does); bytes after them are ignored.
  /// Throws LoadError naming the file and the field: missing or unreadable file, file too short
  /// for max_token_length, entry `i` truncated (fewer entries than `vocab_size`), len negative or
  /// above max_token_length, a score that is NaN or infinite, entries 3..258 not the byte tokens "<0x00>".."<0xFF>" that byte
  /// fallback relies on, `vocab_size` < 259.
  static Tokenizer LoadLlama2c(const std::string& path, int vocab_size);

  /// A byte-level tokenizer: 0 "<unk>", 1 "<s>", 2 "</s>", then 256 byte tokens "<0xHH>"
  /// (id = byte + 3), no merges: vocab_size 259. It has no " " token, hence no dummy prefix, so
  /// Decode(Encode(bytes, ...)) == bytes for any bytes. Used by the embedded default model.
  static Tokenizer ByteLevel();

  /// Encodes as run.c does: optional BOS; a dummy-prefix " " token when text is non-empty (only
  /// if " " is a token: run.c would emit id -1 otherwise); each UTF-8 code point (a byte and up
  /// to 3 continuation bytes) to its token, else byte fallback (id = byte + 3); then repeatedly
  /// merge the adjacent pair whose concatenated piece has the highest score (leftmost on ties;
  /// pairs scoring <= -1e10 never merge); optional EOS. `text` is raw bytes: unlike run.c, an
  /// embedded NUL does not end it. Cost: O(n^2) comparisons for n code points.
  std::vector<TokenId> Encode(std::string_view text, bool add_bos, bool add_eos) const;

  /// The bytes `token` contributes when it follows `prev` (run.c decode): BOS contributes
  /// nothing (run.c never prints it: it stops generating there); after BOS a leading space is
  /// stripped from the piece; a piece spelled "<0xHH>" becomes the raw byte 0xHH. Other pieces,
  /// EOS's "\n</s>\n" included, are returned as stored. run.c's safe_printf filter (dropping
  /// single non-printable bytes) is not applied: it would break multi-byte UTF-8.
  /// Throws std::out_of_range for a `token` outside [0, vocab_size); `prev` is not checked.
  std::string DecodePiece(TokenId prev, TokenId token) const;

  /// Decodes a sequence that starts a text: the token before ids[0] is taken to be BOS, so
  ///   Decode(ids) == DecodePiece(kBos, ids[0]) + DecodePiece(ids[0], ids[1]) + ...
  /// A leading BOS (or any BOS) prints nothing, so Decode({1, a, b}) == Decode({a, b}), and
  /// Decode(Encode(s, bos, false)) == s when every piece round-trips (tok512 and ByteLevel do).
  /// To decode a continuation, call DecodePiece with the true previous token instead.
  std::string Decode(const std::vector<TokenId>& ids) const;

  /// Number of tokens: ids are [0, vocab_size).
  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  /// The stored bytes of token `id` (e.g. " Once", "<0x0A>", "\n<s>\n"); throws std::out_of_range.
  const std::string& piece(TokenId id) const { return pieces_.at(id); }
  /// The file's max_token_length header field (6 for ByteLevel()): no piece is longer.
  int max_token_length() const { return max_token_length_; }

 private:
  // Builds lookup_ from `pieces` (the first id wins for a duplicated piece).
  Tokenizer(std::vector<std::string> pieces, std::vector<float> scores, int max_token_length);

  std::vector<std::string> pieces_;  // bytes of each token, indexed by id
  std::vector<float> scores_;
  std::unordered_map<std::string, TokenId> lookup_;  // piece -> id
  int max_token_length_ = 0;
};

}  // namespace vroll::policy
