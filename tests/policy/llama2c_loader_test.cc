// llama2.c checkpoint loader and tokenizer-file tests. Oracles: the stories260K header and byte
// count from ../shared/models/SOURCES.md, raw reads of the file at float offsets computed here by
// hand from the documented layout, and corrupt files made by patching bytes.
#include "policy/llama2c_loader.h"

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "policy/errors.h"
#include "policy/tokenizer.h"
#include "tests/support/comparisons.h"
#include "tests/support/reference_data.h"
#include "tests/support/test_paths.h"

namespace vroll::policy {
namespace {

namespace fs = std::filesystem;
using vroll::testing::BitEqual;
using vroll::testing::ReadBytes;
using vroll::testing::WriteBytes;

float FloatAt(const std::string& bytes, int64_t byte_offset) {
  float value;
  std::memcpy(&value, bytes.data() + byte_offset, sizeof(value));
  return value;
}

void PatchInt32(std::string* bytes, int64_t byte_offset, int32_t value) {
  std::memcpy(bytes->data() + byte_offset, &value, sizeof(value));
}

// stories260K float offsets (after the 7-int header), from SOURCES.md: dim 64, hidden 172,
// 5 layers, kv_dim 32, vocab 512, seq 512, head_size 8.
constexpr int64_t kTok = 0;                         // [512, 64]
constexpr int64_t kRmsAtt = kTok + 512 * 64;        // [5, 64]
constexpr int64_t kWq = kRmsAtt + 5 * 64;           // [5, 64, 64]
constexpr int64_t kWk = kWq + 5 * 64 * 64;          // [5, 32, 64]
constexpr int64_t kWv = kWk + 5 * 32 * 64;          // [5, 32, 64]
constexpr int64_t kWo = kWv + 5 * 32 * 64;          // [5, 64, 64]
constexpr int64_t kRmsFfn = kWo + 5 * 64 * 64;      // [5, 64]
constexpr int64_t kW1 = kRmsFfn + 5 * 64;           // [5, 172, 64]
constexpr int64_t kW2 = kW1 + 5 * 172 * 64;         // [5, 64, 172]
constexpr int64_t kW3 = kW2 + 5 * 64 * 172;         // [5, 172, 64]
constexpr int64_t kRmsFinal = kW3 + 5 * 172 * 64;   // [64]
constexpr int64_t kFreqCis = kRmsFinal + 64;        // 2 x [512 * 8 / 2]
constexpr int64_t kEnd = kFreqCis + 2 * 512 * 8 / 2;
static_assert(kEnd == 264128, "SOURCES.md: 28 + 4*264128 = 1056540 bytes");
constexpr int64_t Byte(int64_t float_offset) { return 28 + 4 * float_offset; }

class Llama2cFilesTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTestDir("vroll_policy_test_"); }
  void TearDown() override { fs::remove_all(dir_); }

  std::string TempPath(const std::string& name) const { return (dir_ / name).string(); }
  static std::string StoriesPath() { return testing::SharedPath("models/stories260K.bin"); }
  static std::string Tok512Path() { return testing::SharedPath("models/tok512.bin"); }

  // Loading `bytes` (written to `name`) throws LoadError whose message holds the path and every
  // string of `needles`.
  void ExpectLoadError(const std::string& name, const std::string& bytes, const std::vector<std::string>& needles) {
    const std::string path = TempPath(name);
    WriteBytes(path, bytes);
    ExpectCheckpointError(path, needles);
  }
  static void ExpectCheckpointError(const std::string& path, const std::vector<std::string>& needles) {
    try {
      LoadLlama2cCheckpoint(path);
      ADD_FAILURE() << "no LoadError for " << path;
    } catch (const LoadError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << what;
      for (const std::string& needle : needles) EXPECT_NE(what.find(needle), std::string::npos) << what;
    }
  }
  static void ExpectTokenizerError(const std::string& path, int vocab_size, const std::vector<std::string>& needles) {
    try {
      Tokenizer::LoadLlama2c(path, vocab_size);
      ADD_FAILURE() << "no LoadError for " << path;
    } catch (const LoadError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << what;
      for (const std::string& needle : needles) EXPECT_NE(what.find(needle), std::string::npos) << what;
    }
  }

  fs::path dir_;
};

TEST_F(Llama2cFilesTest, LoadsStories260KConfig) {
  VROLL_REQUIRE_SHARED();
  const Checkpoint ckpt = LoadLlama2cCheckpoint(StoriesPath());
  const ModelConfig& c = ckpt.config;
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.rope_layout, RopeLayout::kInterleaved);
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.norm_eps, 1e-5f);
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_EQ(c.kv_dim(), 32);
  EXPECT_EQ(ckpt.weights.size(), 1u + 5 * 9 + 1);  // embedding, 9 per layer, final norm; no lm_head
  EXPECT_EQ(ckpt.weights.count("lm_head.weight"), 0u);
  EXPECT_EQ(c.NumParameters(), kEnd - 2 * 512 * 8 / 2);  // every float but freq_cis
}

TEST_F(Llama2cFilesTest, WeightsMatchRawFileAtComputedOffsets) {
  VROLL_REQUIRE_SHARED();
  const Checkpoint ckpt = LoadLlama2cCheckpoint(StoriesPath());
  const std::string raw = ReadBytes(StoriesPath());
  ASSERT_EQ(raw.size(), 1056540u);
  // Element [row][col] of weight `name`, which is a [rows, cols] matrix or a [cols] vector.
  const auto at = [&ckpt](const std::string& name, int64_t row, int64_t col) {
    const HostTensor& t = ckpt.weights.at(name);
    return t.data.at(row * t.shape.back() + col);
  };
  const std::string l = "model.layers.";
  EXPECT_EQ(at(l + "3.self_attn.k_proj.weight", 7, 5), FloatAt(raw, Byte(kWk + 3 * 32 * 64 + 7 * 64 + 5)));
  EXPECT_EQ(at("model.norm.weight", 0, 10), FloatAt(raw, Byte(kRmsFinal + 10)));
  EXPECT_EQ(at(l + "4.mlp.down_proj.weight", 63, 171), FloatAt(raw, Byte(kW2 + 4 * 64 * 172 + 63 * 172 + 171)));
  EXPECT_EQ(at(l + "4.mlp.down_proj.weight", 1, 2), FloatAt(raw, Byte(kW2 + 4 * 64 * 172 + 1 * 172 + 2)));
  EXPECT_EQ(at(l + "0.mlp.gate_proj.weight", 5, 7), FloatAt(raw, Byte(kW1 + 5 * 64 + 7)));
  EXPECT_EQ(at(l + "2.mlp.up_proj.weight", 100, 3), FloatAt(raw, Byte(kW3 + 2 * 172 * 64 + 100 * 64 + 3)));
  EXPECT_EQ(at("model.embed_tokens.weight", 511, 63), FloatAt(raw, Byte(kTok + 511 * 64 + 63)));
  EXPECT_EQ(at(l + "1.self_attn.q_proj.weight", 9, 60), FloatAt(raw, Byte(kWq + 1 * 64 * 64 + 9 * 64 + 60)));
  EXPECT_EQ(at(l + "2.self_attn.v_proj.weight", 31, 0), FloatAt(raw, Byte(kWv + 2 * 32 * 64 + 31 * 64)));
  EXPECT_EQ(at(l + "4.self_attn.o_proj.weight", 62, 1), FloatAt(raw, Byte(kWo + 4 * 64 * 64 + 62 * 64 + 1)));
  EXPECT_EQ(at(l + "2.input_layernorm.weight", 0, 33), FloatAt(raw, Byte(kRmsAtt + 2 * 64 + 33)));
  EXPECT_EQ(at(l + "1.post_attention_layernorm.weight", 0, 4), FloatAt(raw, Byte(kRmsFfn + 1 * 64 + 4)));
  // Shapes are nn.Linear [out, in].
  EXPECT_EQ(ckpt.weights.at(l + "0.self_attn.k_proj.weight").shape, (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(ckpt.weights.at(l + "0.mlp.down_proj.weight").shape, (std::vector<int64_t>{64, 172}));
  EXPECT_EQ(ckpt.weights.at(l + "0.mlp.gate_proj.weight").shape, (std::vector<int64_t>{172, 64}));
}

TEST_F(Llama2cFilesTest, SaveIsTheInverseOfLoadForStories260K) {
  VROLL_REQUIRE_SHARED();
  const Checkpoint ckpt = LoadLlama2cCheckpoint(StoriesPath());
  const std::string path = TempPath("resaved.bin");
  SaveLlama2cCheckpoint(ckpt, path);
  // The bytes are the original's, except freq_cis (unused by run.c), which is written as zeros.
  const std::string original = ReadBytes(StoriesPath());
  std::string saved = ReadBytes(path);
  ASSERT_EQ(saved.size(), original.size());
  EXPECT_EQ(saved.substr(0, Byte(kFreqCis)), original.substr(0, Byte(kFreqCis)));
  EXPECT_EQ(saved.substr(Byte(kFreqCis)), std::string(Byte(kEnd) - Byte(kFreqCis), '\0'));
  const Checkpoint reloaded = LoadLlama2cCheckpoint(path);
  EXPECT_TRUE(BitEqual(reloaded.weights, ckpt.weights));
  EXPECT_EQ(reloaded.config.ToString(), ckpt.config.ToString());
}

TEST_F(Llama2cFilesTest, UntiedCheckpointRoundTripsWithNegativeVocabSize) {
  Checkpoint ckpt;
  ModelConfig& c = ckpt.config;
  c.dim = 16;
  c.hidden_dim = 40;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 300;
  c.max_seq_len = 32;
  c.tie_word_embeddings = false;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (const auto& [name, shape] : ExpectedWeightShapes(c)) {
    HostTensor t{shape, {}};
    t.data.resize(t.numel());
    for (float& x : t.data) x = normal(rng);
    ckpt.weights[name] = std::move(t);
  }
  ckpt.weights["model.norm.weight"].data[0] = -0.0f;  // bit patterns, not just values, survive
  ckpt.weights["model.norm.weight"].data[1] = std::numeric_limits<float>::denorm_min();
  const std::string path = TempPath("untied.bin");
  SaveLlama2cCheckpoint(ckpt, path);

  const std::string raw = ReadBytes(path);
  int32_t header[7];
  ASSERT_GE(raw.size(), sizeof(header));
  std::memcpy(header, raw.data(), sizeof(header));
  EXPECT_EQ(std::vector<int32_t>(header, header + 7), (std::vector<int32_t>{16, 40, 2, 4, 2, -300, 32}));
  // 16*300 embedding, per layer 2*16 norms + 16*16 q + 2*8*16 k,v + 16*16 o + 3*40*16 mlp,
  // 16 final norm, 2 x 32*4/2 freq_cis, 300*16 wcls.
  const int64_t floats = 300 * 16 + 2 * (2 * 16 + 16 * 16 + 2 * 8 * 16 + 16 * 16 + 3 * 40 * 16) + 16 + 2 * 64 + 300 * 16;
  ASSERT_EQ(static_cast<int64_t>(raw.size()), 28 + 4 * floats);
  const HostTensor& lm_head = ckpt.weights.at("lm_head.weight");  // wcls comes last
  EXPECT_EQ(std::memcmp(raw.data() + raw.size() - 4 * lm_head.data.size(), lm_head.data.data(),
                        4 * lm_head.data.size()),
            0);

  const Checkpoint reloaded = LoadLlama2cCheckpoint(path);
  EXPECT_FALSE(reloaded.config.tie_word_embeddings);
  EXPECT_EQ(reloaded.config.vocab_size, 300);
  EXPECT_TRUE(BitEqual(reloaded.weights, ckpt.weights));
}

TEST_F(Llama2cFilesTest, SaveRejectsWhatTheFormatCannotHold) {
  Checkpoint ckpt;
  ckpt.config = ModelConfig{16, 40, 1, 4, 2, 259, 8};
  ckpt.config.rope_layout = RopeLayout::kHalfSplit;
  EXPECT_THROW(SaveLlama2cCheckpoint(ckpt, TempPath("x.bin")), ConfigError);
  ckpt.config.rope_layout = RopeLayout::kInterleaved;
  EXPECT_THROW(SaveLlama2cCheckpoint(ckpt, TempPath("x.bin")), LoadError);  // no weights
}

TEST_F(Llama2cFilesTest, CorruptCheckpointsThrowLoadErrorNamingFileAndField) {
  VROLL_REQUIRE_SHARED();
  const std::string good = ReadBytes(StoriesPath());
  ExpectCheckpointError(TempPath("missing.bin"), {"cannot open"});
  ExpectLoadError("short.bin", good.substr(0, 10), {"file is 10 bytes", "header"});
  ExpectLoadError("truncated.bin", good.substr(0, Byte(kW2 + 1000)),
                  {"file is " + std::to_string(Byte(kW2 + 1000)) + " bytes", "implies 1056540 bytes", "truncated inside w2"});
  ExpectLoadError("no_freq_cis.bin", good.substr(0, Byte(kFreqCis)), {"truncated inside freq_cis_real"});
  ExpectLoadError("trailing.bin", good + "abcd", {"file is 1056544 bytes", "4 trailing bytes"});

  const char* fields[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
  for (int i = 0; i < 7; ++i) {
    for (int32_t value : {0, -3}) {
      if (i == 5 && value < 0) continue;  // a negative vocab_size is legal: see below
      std::string bad = good;
      PatchInt32(&bad, 4 * i, value);
      SCOPED_TRACE(fields[i]);
      ExpectLoadError("dims.bin", bad, {std::string("header field ") + fields[i] + " = " + std::to_string(value)});
    }
  }
  std::string bad = good;
  PatchInt32(&bad, 4 * 5, -512);  // claims an unshared classifier the file does not have
  ExpectLoadError("untied.bin", bad, {"vocab_size=-512", "truncated inside wcls"});
  bad = good;
  PatchInt32(&bad, 4 * 3, 7);
  ExpectLoadError("heads.bin", bad, {"header field n_heads = 7 does not divide dim = 64"});
  bad = good;
  PatchInt32(&bad, 4 * 4, 3);
  ExpectLoadError("kv_heads.bin", bad, {"header field n_kv_heads = 3 does not divide n_heads = 8"});
  bad = good;
  PatchInt32(&bad, 4 * 3, 64);  // head_dim 1
  ExpectLoadError("odd_head.bin", bad, {"header field n_heads = 64", "odd head_dim"});
  bad = good;  // sizes that overflow int64 must not wrap around to something plausible
  for (int i : {0, 1, 2}) PatchInt32(&bad, 4 * i, 1 << 30);
  PatchInt32(&bad, 4 * 3, 2);
  PatchInt32(&bad, 4 * 4, 2);
  ExpectLoadError("huge.bin", bad, {"header field", "overflows int64"});
  // A NaN weight is named with the file (it was found later, as "model: weight ...").
  bad = good;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&bad[Byte(5 * 64 + 3)], &nan, 4);  // token embedding [5, 3]
  ExpectLoadError("nan.bin", bad, {"nan.bin: weight model.embed_tokens.weight element [5, 3] is nan"});
}

// Serializes a tokenizer file from raw fields, so a test can write what the format forbids.
struct RawEntry {
  float score;
  int32_t len;
  std::string bytes;
};
std::string TokenizerFile(uint32_t max_token_length, const std::vector<RawEntry>& entries) {
  std::string out(reinterpret_cast<const char*>(&max_token_length), 4);
  for (const RawEntry& e : entries) {
    out.append(reinterpret_cast<const char*>(&e.score), 4);
    out.append(reinterpret_cast<const char*>(&e.len), 4);
    out += e.bytes;
  }
  return out;
}
std::vector<RawEntry> ByteLevelEntries() {
  const Tokenizer byte_level = Tokenizer::ByteLevel();
  std::vector<RawEntry> entries;
  for (int i = 0; i < byte_level.vocab_size(); ++i) {
    const std::string& p = byte_level.piece(i);
    entries.push_back({0.0f, static_cast<int32_t>(p.size()), p});
  }
  return entries;
}

TEST_F(Llama2cFilesTest, CorruptTokenizersThrowLoadErrorNamingFileAndField) {
  VROLL_REQUIRE_SHARED();
  ExpectTokenizerError(TempPath("missing.bin"), 512, {"cannot open"});
  // A directory (std::ios_base::failure from the read before, without the path).
  ExpectTokenizerError(TempPath(""), 512, {"cannot read tokenizer file", "directory"});
  // tok512 holds exactly 512 entries.
  ExpectTokenizerError(Tok512Path(), 600, {"entry 512 of 600 is truncated", "fewer entries than vocab_size 600"});
  const std::string tok512 = ReadBytes(Tok512Path());
  const std::string cut = TempPath("cut.bin");
  WriteBytes(cut, tok512.substr(0, tok512.size() - 3));
  ExpectTokenizerError(cut, 512, {"entry 511 of 512 is truncated at field bytes"});
  WriteBytes(cut, tok512.substr(0, 2));
  ExpectTokenizerError(cut, 512, {"not a llama2.c tokenizer", "max_token_length"});
  // A file of another kind (the checkpoint passed as --tokenizer) says so, not only which field.
  ExpectTokenizerError(StoriesPath(), 512, {"not a llama2.c tokenizer", "entry 2 of 512"});

  std::vector<RawEntry> entries = ByteLevelEntries();
  entries[5].len = -1;
  const std::string path = TempPath("tok.bin");
  WriteBytes(path, TokenizerFile(6, entries));
  ExpectTokenizerError(path, 259, {"entry 5 of 259 field len = -1"});
  entries = ByteLevelEntries();
  entries[5].len = 7;  // longer than max_token_length = 6
  entries[5].bytes = "<0x02>x";
  WriteBytes(path, TokenizerFile(6, entries));
  ExpectTokenizerError(path, 259, {"entry 5 of 259 field len = 7", "max_token_length = 6"});
  entries = ByteLevelEntries();
  entries[7].score = std::numeric_limits<float>::quiet_NaN();  // helper-62: loaded silently
  WriteBytes(path, TokenizerFile(6, entries));
  ExpectTokenizerError(path, 259, {"entry 7 of 259 field score = nan must be finite"});
  entries[7].score = -std::numeric_limits<float>::infinity();
  WriteBytes(path, TokenizerFile(6, entries));
  ExpectTokenizerError(path, 259, {"entry 7 of 259 field score = -inf must be finite"});
  entries = ByteLevelEntries();
  entries[3 + 0x41].bytes = "<0x42>";  // byte fallback would silently pick the wrong token
  WriteBytes(path, TokenizerFile(6, entries));
  ExpectTokenizerError(path, 259, {"entry 68 of 259", "<0x41>"});
  WriteBytes(path, TokenizerFile(6, ByteLevelEntries()));
  ExpectTokenizerError(path, 100, {"vocab_size = 100"});
  EXPECT_EQ(Tokenizer::LoadLlama2c(path, 259).piece(3 + 0x41), "<0x41>");
}

}  // namespace
}  // namespace vroll::policy
