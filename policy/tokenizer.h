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
  /// Throws LoadError naming the file and the field (missing file, truncated entry `i`,
  /// negative length, fewer entries than `vocab_size`).
  static Tokenizer LoadLlama2c(const std::string& path, int vocab_size);

  /// A byte-level tokenizer: 0 <unk>, 1 <s>, 2 </s>, then 256 byte tokens "<0xHH>" (id = byte + 3),
  /// no merges: vocab_size 259. Used by the embedded default model.
  static Tokenizer ByteLevel();

  /// Encodes as run.c does: optional BOS; a dummy-prefix " " token when text is non-empty; each
  /// UTF-8 code point to its token, else byte fallback (id = byte + 3); then repeatedly merge the
  /// adjacent pair whose merged string has the highest score; optional EOS.
  std::vector<TokenId> Encode(std::string_view text, bool add_bos, bool add_eos) const;

  /// The bytes `token` contributes after `prev` (run.c decode): after BOS a leading space is
  /// stripped; "<0xHH>" pieces become the raw byte. Throws std::out_of_range for ids outside
  /// [0, vocab_size).
  std::string DecodePiece(TokenId prev, TokenId token) const;

  /// Concatenated DecodePiece over `ids`, starting from prev = ids[0] when it is BOS (which
  /// itself prints nothing), else from prev = BOS... (see tokenizer.cc for the exact rule).
  std::string Decode(const std::vector<TokenId>& ids) const;

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  const std::string& piece(TokenId id) const { return pieces_.at(id); }

 private:
  Tokenizer() = default;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, TokenId> lookup_;
  int max_token_length_ = 0;
};

}  // namespace vroll::policy
