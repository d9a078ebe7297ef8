#include "policy/tokenizer.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "policy/errors.h"
#include "policy/logging.h"

namespace vroll::policy {

namespace {

constexpr int kFirstByteToken = 3;  // ids [3, 259) are the byte-fallback tokens "<0x00>".."<0xFF>"
constexpr int kNumByteTokens = 256;

std::string BytePiece(int byte) { return fmt::format("<0x{:02X}>", byte); }

// The byte of a piece spelled exactly "<0xHH>" (hex digits in either case), else nullopt.
std::optional<unsigned char> ParseBytePiece(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return std::nullopt;
  int value = 0;
  for (char c : piece.substr(3, 2)) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    value = value * 16 + digit;
  }
  return static_cast<unsigned char>(value);
}

// Bounds-checked little-endian reads from a file held in memory.
class ByteReader {
 public:
  explicit ByteReader(std::string_view data) : data_(data) {}
  // Copies sizeof(T) bytes into *out and advances; false (nothing read) when fewer remain.
  template <typename T>
  bool Read(T* out) {
    if (data_.size() - offset_ < sizeof(T)) return false;
    std::memcpy(out, data_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return true;
  }
  // Returns the next `n` bytes and advances; nullopt (nothing read) when fewer remain.
  std::optional<std::string_view> ReadBytes(size_t n) {
    if (data_.size() - offset_ < n) return std::nullopt;
    std::string_view bytes = data_.substr(offset_, n);
    offset_ += n;
    return bytes;
  }
  size_t offset() const { return offset_; }

 private:
  std::string_view data_;
  size_t offset_ = 0;
};

}  // namespace

Tokenizer::Tokenizer(std::vector<std::string> pieces, std::vector<float> scores, int max_token_length)
    : pieces_(std::move(pieces)), scores_(std::move(scores)), max_token_length_(max_token_length) {
  // emplace keeps the first id of a duplicated piece (tokenizer files have none).
  for (TokenId id = 0; id < static_cast<TokenId>(pieces_.size()); ++id) lookup_.emplace(pieces_[id], id);
}

Tokenizer Tokenizer::LoadLlama2c(const std::string& path, int vocab_size) {
  if (vocab_size < kFirstByteToken + kNumByteTokens) {
    throw LoadError(fmt::format("{}: vocab_size = {} must be >= {} (3 special tokens and 256 byte tokens)", path,
                                vocab_size, kFirstByteToken + kNumByteTokens));
  }
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    throw LoadError(fmt::format("{}: cannot read tokenizer file: it is a directory", path));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw LoadError(fmt::format("{}: cannot open tokenizer file: {}", path, std::strerror(errno)));
  std::string data;
  try {  // libstdc++'s filebuf throws std::ios_base::failure on a read error, whatever the mask
    data.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {
    throw LoadError(fmt::format("{}: cannot read tokenizer file: {}", path, e.what()));
  }
  if (in.bad()) throw LoadError(fmt::format("{}: cannot read tokenizer file: {}", path, std::strerror(errno)));

  ByteReader reader(data);
  uint32_t max_token_length = 0;
  if (!reader.Read(&max_token_length)) {
    throw LoadError(fmt::format(
        "{}: not a llama2.c tokenizer: file is {} bytes, too short for the header field max_token_length", path,
        data.size()));
  }
  if (max_token_length > static_cast<uint32_t>(INT32_MAX)) {
    throw LoadError(fmt::format("{}: not a llama2.c tokenizer: header field max_token_length = {} must be <= {}",
                                path, max_token_length, INT32_MAX));
  }
  std::vector<std::string> pieces;
  std::vector<float> scores;
  for (int i = 0; i < vocab_size; ++i) {
    const auto truncated = [&](const char* field) {
      return LoadError(fmt::format(
          "{}: not a llama2.c tokenizer of this model: entry {} of {} is truncated at field {} (offset {} of {} "
          "bytes; the file has fewer entries than vocab_size {})",
          path, i, vocab_size, field, reader.offset(), data.size(), vocab_size));
    };
    float score = 0;
    int32_t len = 0;
    if (!reader.Read(&score)) throw truncated("score");
    if (!reader.Read(&len)) throw truncated("len");
    if (!std::isfinite(score)) {  // a corrupt file: NaN would never merge, inf always first
      throw LoadError(fmt::format("{}: not a llama2.c tokenizer: entry {} of {} field score = {} must be finite", path,
                                  i, vocab_size, score));
    }
    if (len < 0 || static_cast<uint32_t>(len) > max_token_length) {
      throw LoadError(fmt::format(
          "{}: not a llama2.c tokenizer: entry {} of {} field len = {} must be in [0, max_token_length = {}]", path, i,
          vocab_size, len, max_token_length));
    }
    const std::optional<std::string_view> bytes = reader.ReadBytes(static_cast<size_t>(len));
    if (!bytes) throw truncated("bytes");
    if (i >= kFirstByteToken && i < kFirstByteToken + kNumByteTokens && *bytes != BytePiece(i - kFirstByteToken)) {
      throw LoadError(fmt::format("{}: not a llama2.c tokenizer: entry {} of {} is \"{}\" but byte-fallback entries "
                                  "3..258 must be \"<0x00>\"..\"<0xFF>\" (expected \"{}\")",
                                  path, i, vocab_size, *bytes, BytePiece(i - kFirstByteToken)));
    }
    pieces.emplace_back(*bytes);
    scores.push_back(score);
  }
  Logger("policy").info("loaded tokenizer {}: vocab_size={} max_token_length={} ({} of {} bytes used)", path,
                        vocab_size, max_token_length, reader.offset(), data.size());
  if (reader.offset() < data.size()) {
    // llama2.c reads vocab_size entries and ignores the rest; a tokenizer of a larger vocabulary
    // (or another file appended) loads the same way, so say so.
    Logger("policy").warn("tokenizer {}: {} bytes follow the model's {} entries and are ignored (the tokenizer of a "
                          "larger vocabulary?)",
                          path, data.size() - reader.offset(), vocab_size);
  }
  return Tokenizer(std::move(pieces), std::move(scores), static_cast<int>(max_token_length));
}

Tokenizer Tokenizer::ByteLevel() {
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
  for (int byte = 0; byte < kNumByteTokens; ++byte) pieces.push_back(BytePiece(byte));
  std::vector<float> scores(pieces.size(), 0.0f);
  return Tokenizer(std::move(pieces), std::move(scores), /*max_token_length=*/6);
}

std::vector<TokenId> Tokenizer::Encode(std::string_view text, bool add_bos, bool add_eos) const {
  std::vector<TokenId> tokens;
  if (add_bos) tokens.push_back(kBos);
  if (!text.empty()) {
    const auto dummy_prefix = lookup_.find(" ");
    if (dummy_prefix != lookup_.end()) tokens.push_back(dummy_prefix->second);
  }
  // Code points: a byte and the continuation bytes (10xxxxxx) after it, at most 4 bytes in all.
  for (size_t begin = 0; begin < text.size();) {
    size_t end = begin + 1;
    while (end < text.size() && end - begin < 4 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
    const auto it = lookup_.find(std::string(text.substr(begin, end - begin)));
    if (it != lookup_.end()) {
      tokens.push_back(it->second);
    } else {
      for (size_t i = begin; i < end; ++i) tokens.push_back(static_cast<unsigned char>(text[i]) + kFirstByteToken);
    }
    begin = end;
  }

  // Merge the pair (i, i+1) whose concatenation has the highest score, leftmost on ties, until no
  // pair is a token. pair_id[i] caches the token of pieces i and i+1 (-1: none); a merge at i
  // changes only the pairs at i-1 and i. O(n^2) comparisons, O(n) string look-ups.
  const auto pair_token = [this, &tokens](size_t i) {
    const auto it = lookup_.find(pieces_[tokens[i]] + pieces_[tokens[i + 1]]);
    return it == lookup_.end() ? TokenId{-1} : it->second;
  };
  std::vector<TokenId> pair_id;
  for (size_t i = 0; i + 1 < tokens.size(); ++i) pair_id.push_back(pair_token(i));
  while (true) {
    float best_score = -1e10f;  // as run.c: a pair scoring <= -1e10 never merges
    size_t best = pair_id.size();
    for (size_t i = 0; i < pair_id.size(); ++i) {
      if (pair_id[i] != -1 && scores_[pair_id[i]] > best_score) {
        best_score = scores_[pair_id[i]];
        best = i;
      }
    }
    if (best == pair_id.size()) break;
    tokens[best] = pair_id[best];
    tokens.erase(tokens.begin() + best + 1);
    pair_id.erase(pair_id.begin() + best);
    if (best > 0) pair_id[best - 1] = pair_token(best - 1);
    if (best + 1 < tokens.size()) pair_id[best] = pair_token(best);
  }
  if (add_eos) tokens.push_back(kEos);
  return tokens;
}

std::string Tokenizer::DecodePiece(TokenId prev, TokenId token) const {
  if (token < 0 || token >= vocab_size()) {
    throw std::out_of_range(fmt::format("token id {} outside [0, {})", token, vocab_size()));
  }
  if (token == kBos) return "";
  std::string_view piece = pieces_[token];
  if (prev == kBos && !piece.empty() && piece[0] == ' ') piece.remove_prefix(1);
  if (const auto byte = ParseBytePiece(piece)) return std::string(1, static_cast<char>(*byte));
  return std::string(piece);
}

std::string Tokenizer::Decode(const std::vector<TokenId>& ids) const {
  std::string text;
  TokenId prev = kBos;
  for (TokenId id : ids) {
    text += DecodePiece(prev, id);
    prev = id;
  }
  return text;
}

}  // namespace vroll::policy
