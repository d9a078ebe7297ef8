// ModelConfig and weight-shape tests. Oracles: the published parameter counts of TinyLlama-1.1B
// (1,100,048,384) and Qwen2-0.5B (494,032,768), and the stories260K file size from SOURCES.md.
#include "policy/model_config.h"

#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <spdlog/sinks/stdout_color_sinks.h>

#include "policy/errors.h"
#include "policy/logging.h"
#include "policy/weights.h"

namespace vroll::policy {
namespace {

ModelConfig Stories260K() { return ModelConfig{64, 172, 5, 8, 4, 512, 512}; }

ModelConfig TinyLlama() {
  ModelConfig c{2048, 5632, 22, 32, 4, 32000, 2048};
  c.tie_word_embeddings = false;
  c.rope_layout = RopeLayout::kHalfSplit;
  return c;
}

ModelConfig Qwen2_0_5B() {
  ModelConfig c{896, 4864, 24, 14, 2, 151936, 32768};
  c.attention_bias = true;
  c.rope_theta = 1000000.0f;
  c.norm_eps = 1e-6f;
  return c;
}

// Validate() throws ConfigError whose message contains `needle`.
void ExpectInvalid(const ModelConfig& c, const std::string& needle) {
  try {
    c.Validate("cfg.json");
    ADD_FAILURE() << "no ConfigError for " << c.ToString();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.json field " + needle), std::string::npos) << e.what();
  }
}

TEST(ModelConfigTest, NumParametersMatchesPublishedCounts) {
  EXPECT_EQ(TinyLlama().NumParameters(), 1100048384);
  EXPECT_EQ(Qwen2_0_5B().NumParameters(), 494032768);
  // stories260K.bin: 264128 floats, of which 2 x 512*8/2 are freq_cis tables.
  EXPECT_EQ(Stories260K().NumParameters(), 264128 - 4096);
}

TEST(ModelConfigTest, NumParametersIsTheSumOfExpectedWeightShapes) {
  for (const ModelConfig& c : {Stories260K(), TinyLlama(), Qwen2_0_5B()}) {
    int64_t sum = 0;
    for (const auto& [name, shape] : ExpectedWeightShapes(c)) sum += HostTensor{shape, {}}.numel();
    EXPECT_EQ(sum, c.NumParameters()) << c.ToString();
  }
}

TEST(ModelConfigTest, ValidAcceptsRealConfigs) {
  EXPECT_NO_THROW(Stories260K().Validate());
  EXPECT_NO_THROW(TinyLlama().Validate());
  EXPECT_NO_THROW(Qwen2_0_5B().Validate());
}

TEST(ModelConfigTest, ValidateNamesTheBadField) {
  const std::pair<const char*, int ModelConfig::*> fields[] = {
      {"dim", &ModelConfig::dim},           {"hidden_dim", &ModelConfig::hidden_dim},
      {"n_layers", &ModelConfig::n_layers}, {"n_heads", &ModelConfig::n_heads},
      {"n_kv_heads", &ModelConfig::n_kv_heads}, {"vocab_size", &ModelConfig::vocab_size},
      {"max_seq_len", &ModelConfig::max_seq_len},
  };
  for (const auto& [name, member] : fields) {
    for (int value : {0, -1, INT_MIN}) {
      ModelConfig c = Stories260K();
      c.*member = value;
      ExpectInvalid(c, std::string(name) + " = " + std::to_string(value) + " must be > 0");
    }
  }
  ModelConfig c = Stories260K();
  c.n_heads = 6;
  ExpectInvalid(c, "n_heads = 6 does not divide dim = 64");
  c = Stories260K();
  c.n_kv_heads = 3;
  ExpectInvalid(c, "n_kv_heads = 3 does not divide n_heads = 8");
  c = Stories260K();
  c.n_heads = c.n_kv_heads = 64;
  ExpectInvalid(c, "n_heads = 64 gives an odd head_dim = 1");
  c = Stories260K();
  c.max_seq_len = INT_MAX;  // RoPE tables of 64 GiB (helper-70: an allocator error naming nothing)
  ExpectInvalid(c, "max_seq_len = 2147483647 is too long: its RoPE tables");
  c.max_seq_len = static_cast<int>(ModelConfig::kMaxRopeTableBytes / (4 * c.head_dim()));  // the most: fine
  EXPECT_NO_THROW(c.Validate());
  ++c.max_seq_len;
  ExpectInvalid(c, "max_seq_len = " + std::to_string(c.max_seq_len) + " is too long");
  c = Stories260K();
  c.norm_eps = 0.0f;
  ExpectInvalid(c, "norm_eps = 0");
  c = Stories260K();
  c.rope_theta = -1.0f;
  ExpectInvalid(c, "rope_theta = -1");
  c = Stories260K();
  c.dim = c.hidden_dim = c.n_layers = c.vocab_size = INT_MAX - 1;
  c.n_heads = c.n_kv_heads = 1;
  try {
    c.Validate("cfg.json");
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("overflows int64"), std::string::npos) << e.what();
  }
}

TEST(ModelConfigTest, ToStringShowsEveryField) {
  EXPECT_EQ(Stories260K().ToString(),
            "dim=64 hidden_dim=172 layers=5 heads=8/4 vocab=512 seq=512 rope=interleaved theta=10000 eps=1e-05 "
            "tied=true bias=false");
}

TEST(ModelConfigDeathTest, NumParametersOfAnOverflowingConfigAborts) {
  ModelConfig c = Stories260K();
  c.dim = c.hidden_dim = c.n_layers = INT_MAX - 1;
  c.n_heads = c.n_kv_heads = 1;
  EXPECT_DEATH(c.NumParameters(), "NumParameters\\(\\) of an invalid config");
}

TEST(WeightsTest, ExpectedWeightShapesListsCanonicalNamesInOrder) {
  ModelConfig c = Qwen2_0_5B();
  c.n_layers = 1;
  c.tie_word_embeddings = false;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"model.embed_tokens.weight", {151936, 896}},
      {"model.layers.0.input_layernorm.weight", {896}},
      {"model.layers.0.self_attn.q_proj.weight", {896, 896}},
      {"model.layers.0.self_attn.k_proj.weight", {128, 896}},
      {"model.layers.0.self_attn.v_proj.weight", {128, 896}},
      {"model.layers.0.self_attn.q_proj.bias", {896}},
      {"model.layers.0.self_attn.k_proj.bias", {128}},
      {"model.layers.0.self_attn.v_proj.bias", {128}},
      {"model.layers.0.self_attn.o_proj.weight", {896, 896}},
      {"model.layers.0.post_attention_layernorm.weight", {896}},
      {"model.layers.0.mlp.gate_proj.weight", {4864, 896}},
      {"model.layers.0.mlp.up_proj.weight", {4864, 896}},
      {"model.layers.0.mlp.down_proj.weight", {896, 4864}},
      {"model.norm.weight", {896}},
      {"lm_head.weight", {151936, 896}},
  };
  EXPECT_EQ(ExpectedWeightShapes(c), expected);
}

WeightMap ZeroWeights(const ModelConfig& c) {
  WeightMap weights;
  for (const auto& [name, shape] : ExpectedWeightShapes(c)) {
    HostTensor t{shape, {}};
    t.data.assign(t.numel(), 0.0f);
    weights[name] = std::move(t);
  }
  return weights;
}

// ValidateWeights(c, weights) throws LoadError whose message contains `needle`.
void ExpectBadWeights(const ModelConfig& c, const WeightMap& weights, const std::string& needle) {
  try {
    ValidateWeights(c, weights, "ckpt");
    ADD_FAILURE() << "no LoadError";
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("ckpt: " + needle), std::string::npos) << e.what();
  }
}

TEST(WeightsTest, ValidateWeightsNamesTheBadWeight) {
  const ModelConfig c = Stories260K();
  WeightMap weights = ZeroWeights(c);
  EXPECT_NO_THROW(ValidateWeights(c, weights, "ckpt"));

  WeightMap bad = weights;
  bad.erase("model.layers.2.mlp.up_proj.weight");
  ExpectBadWeights(c, bad, "missing weight model.layers.2.mlp.up_proj.weight");
  bad = weights;
  bad["model.layers.1.self_attn.k_proj.weight"].shape = {64, 32};
  ExpectBadWeights(c, bad, "weight model.layers.1.self_attn.k_proj.weight has shape [64, 32], expected [32, 64]");
  bad = weights;
  bad["model.norm.weight"].data.pop_back();
  ExpectBadWeights(c, bad, "weight model.norm.weight holds 63 values but its shape [64] needs 64");
  bad = weights;
  bad["lm_head.weight"] = weights.at("model.embed_tokens.weight");  // tied: no lm_head expected
  ExpectBadWeights(c, bad, "unexpected weight lm_head.weight");
  bad = weights;
  bad["model.layers.3.mlp.down_proj.weight"].data[777] = std::nanf("");
  // Row-major [row, column]: down_proj is [dim 64, hidden_dim 172], 777 = 4 * 172 + 89.
  ExpectBadWeights(c, bad, "weight model.layers.3.mlp.down_proj.weight element [4, 89] is nan (weights must be finite)");
  bad = weights;
  bad["model.embed_tokens.weight"].data.back() = -INFINITY;
  ExpectBadWeights(c, bad, "weight model.embed_tokens.weight element [511, 63] is -inf");
  bad = weights;
  bad["model.norm.weight"].data[5] = INFINITY;
  ExpectBadWeights(c, bad, "weight model.norm.weight element [5] is inf");
}

}  // namespace
}  // namespace vroll::policy

namespace vroll::policy {
namespace {

TEST(DescribeErrorTest, LibTorchErrorsLoseTheirBacktraceOursStayWhole) {
  // Oracle: LibTorch's own what() of the same error, which carries the backtrace lines.
  try {
    TORCH_CHECK(false, "boom: tensor x has 3 dims");
  } catch (const c10::Error& e) {
    const std::string shown = DescribeError(e);
    EXPECT_NE(shown.find("boom: tensor x has 3 dims"), std::string::npos) << shown;
    EXPECT_EQ(shown.find('\n'), std::string::npos) << shown;
    EXPECT_GT(std::string(e.what()).size(), shown.size());  // what() holds more: the backtrace
  }
  const LoadError ours("stories.bin: header field n_heads = 0 must be > 0");
  EXPECT_EQ(DescribeError(ours), ours.what());
}

}  // namespace
}  // namespace vroll::policy

namespace vroll {
namespace {

// helper-74: vroll registered its loggers as "policy", "cache", ... in spdlog's global registry,
// so a host application's own spdlog::stdout_color_mt("cache") threw "logger with name 'cache'
// already exists" (and one made first silently received vroll's lines).
TEST(LoggingTest, LayerLoggersAreRegisteredUnderVrollLeavingPlainNamesToTheHost) {
  spdlog::logger& ours = Logger("cache");
  EXPECT_EQ(ours.name(), "vroll.cache");
  EXPECT_EQ(spdlog::get("vroll.cache").get(), &ours);
  std::shared_ptr<spdlog::logger> host;
  EXPECT_NO_THROW(host = spdlog::stdout_color_mt("cache"));
  EXPECT_NE(host.get(), &ours);
  EXPECT_EQ(&Logger("cache"), &ours);  // the host's logger is not taken for vroll's
  spdlog::drop("cache");
}

}  // namespace
}  // namespace vroll
