// vroll_cache_bench: what the paged KV cache and the radix prefix cache save, on seeded synthetic
// workloads, using the real KvCacheManager (metadata only; no model runs).
//
//   (a) KV memory: paged blocks versus a contiguous slot cache that reserves max_len per sequence.
//   (b) GRPO groups (n samples per prompt): prompt tokens prefilled and peak blocks, with and
//       without prefix caching and forking.
//
// Usage: vroll_cache_bench   (no arguments; prints two tables to stdout, logs to stderr)

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cache/block_pool.h"
#include "cache/kv_cache_manager.h"

namespace {

using vroll::cache::AllocateResult;
using vroll::cache::AppendResult;
using vroll::cache::KvBytesPerBlock;
using vroll::cache::KvCacheConfig;
using vroll::cache::KvCacheManager;
using vroll::cache::KvCacheStats;
using vroll::cache::SeqId;
using vroll::cache::TokenId;

constexpr std::int32_t kBlockSize = 16;
constexpr std::uint64_t kSeed = 20240611;
// Per-token KV of Llama-2-7B in fp16: 2 (K, V) * 32 layers * 32 heads * 128 dims * 2 bytes.
const std::int64_t kBytesPerToken = KvBytesPerBlock(32, 32, 128, /*block_size=*/1, /*dtype_bytes=*/2);
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "cache_bench: %s\n", what);
    std::exit(1);
  }
}

std::vector<TokenId> RandomTokens(std::mt19937_64& rng, int n) {
  std::uniform_int_distribution<TokenId> token(3, 31999);
  std::vector<TokenId> tokens(n);
  for (TokenId& t : tokens) t = token(rng);
  return tokens;
}

KvCacheConfig Config(std::int32_t num_blocks, bool prefix_caching) {
  KvCacheConfig config;
  config.num_blocks = num_blocks;
  config.block_size = kBlockSize;
  config.enable_prefix_caching = prefix_caching;
  config.bytes_per_block = kBytesPerToken * kBlockSize;
  return config;
}

// ---- (a) Paged versus contiguous ---------------------------------------------------------------

void PagedVersusContiguous() {
  constexpr int kNumSeqs = 256;
  constexpr int kMinLen = 16, kMaxLen = 2048;
  std::mt19937_64 rng(kSeed);
  std::uniform_int_distribution<int> length(kMinLen, kMaxLen);

  KvCacheManager cache(Config(kNumSeqs * kMaxLen / kBlockSize, /*prefix_caching=*/false));
  std::int64_t num_tokens = 0;
  for (SeqId seq = 0; seq < kNumSeqs; ++seq) {
    const int len = length(rng);
    num_tokens += len;
    Check(cache.Allocate(seq, RandomTokens(rng, len)).ok(), "paged allocation failed");
  }
  cache.CheckIntegrity();
  const std::int64_t paged_blocks = cache.stats().num_used_blocks;
  const std::int64_t paged_slots = paged_blocks * kBlockSize;
  const std::int64_t contiguous_slots = std::int64_t{kNumSeqs} * kMaxLen;

  std::printf("(a) KV memory: %d sequences, lengths uniform in [%d, %d], max_len %d, block %d,\n", kNumSeqs, kMinLen,
              kMaxLen, kMaxLen, kBlockSize);
  std::printf("    %lld bytes of KV per token (Llama-2-7B, fp16); %lld tokens stored\n\n",
              static_cast<long long>(kBytesPerToken), static_cast<long long>(num_tokens));
  std::printf("    %-34s %12s %10s %10s %8s\n", "layout", "token slots", "blocks", "GiB", "waste %");
  auto row = [&](const char* name, std::int64_t slots, std::int64_t blocks) {
    char blocks_text[32] = "-";
    if (blocks >= 0) std::snprintf(blocks_text, sizeof(blocks_text), "%lld", static_cast<long long>(blocks));
    std::printf("    %-34s %12lld %10s %10.2f %8.2f\n", name, static_cast<long long>(slots), blocks_text,
                static_cast<double>(slots * kBytesPerToken) / kGiB,
                100.0 * static_cast<double>(slots - num_tokens) / static_cast<double>(slots));
  };
  row("contiguous (max_len per sequence)", contiguous_slots, -1);
  row("paged (block 16)", paged_slots, paged_blocks);
  std::printf("    paged uses %.1f%% of the contiguous reservation\n\n",
              100.0 * static_cast<double>(paged_slots) / static_cast<double>(contiguous_slots));
}

// ---- (b) GRPO groups ----------------------------------------------------------------------------

enum class GrpoMode { kIndependent, kCacheTogether, kCacheFirstThenRest, kFork };

struct GrpoResult {
  std::int64_t prompt_tokens = 0;     // prompt tokens over all samples
  std::int64_t prefilled_tokens = 0;  // prompt tokens computed
  double hit_rate = 0;                // prefix-cache hit rate at admission, in tokens
  std::int32_t peak_blocks = 0;
  std::int64_t num_cow_copies = 0;
};

GrpoResult RunGrpo(GrpoMode mode) {
  constexpr int kNumPrompts = 64, kNumSamples = 8, kNumGenerated = 128;
  constexpr int kMinPrompt = 64, kMaxPrompt = 256;
  std::mt19937_64 rng(kSeed + 1);
  std::uniform_int_distribution<int> prompt_len(kMinPrompt, kMaxPrompt);
  std::vector<std::vector<TokenId>> prompts;
  for (int i = 0; i < kNumPrompts; ++i) prompts.push_back(RandomTokens(rng, prompt_len(rng)));

  const bool caching = mode != GrpoMode::kIndependent;
  KvCacheManager cache(Config(kNumPrompts * kNumSamples * (kMaxPrompt + kNumGenerated) / kBlockSize + 64, caching));
  GrpoResult result;
  std::vector<std::vector<TokenId>> tokens(kNumPrompts * kNumSamples);
  auto seq_of = [](int prompt, int sample) { return static_cast<SeqId>(prompt * kNumSamples + sample); };
  auto peak = [&] { result.peak_blocks = std::max(result.peak_blocks, cache.stats().num_used_blocks); };
  auto admit = [&](SeqId seq, const std::vector<TokenId>& prompt) {
    const AllocateResult admitted = cache.Allocate(seq, prompt);
    Check(admitted.ok(), "GRPO admission out of blocks");
    result.prefilled_tokens += static_cast<std::int64_t>(prompt.size()) - admitted.num_cached_tokens;
    tokens[seq] = prompt;
  };
  auto computed = [&](SeqId seq) {  // after the step that computed seq's tokens
    (void)cache.InsertIntoPrefixCache(seq, tokens[seq], static_cast<std::int32_t>(tokens[seq].size()));
  };

  // Admission and prefill.
  for (int p = 0; p < kNumPrompts; ++p) {
    result.prompt_tokens += static_cast<std::int64_t>(prompts[p].size()) * kNumSamples;
    switch (mode) {
      case GrpoMode::kIndependent:
      case GrpoMode::kCacheTogether:  // all n samples in one step: nothing is cached yet
        for (int s = 0; s < kNumSamples; ++s) admit(seq_of(p, s), prompts[p]);
        peak();
        for (int s = 0; s < kNumSamples; ++s) computed(seq_of(p, s));
        break;
      case GrpoMode::kCacheFirstThenRest:  // sample 0 prefilled and cached, the rest admitted next
        admit(seq_of(p, 0), prompts[p]);
        computed(seq_of(p, 0));
        for (int s = 1; s < kNumSamples; ++s) admit(seq_of(p, s), prompts[p]);
        peak();
        for (int s = 1; s < kNumSamples; ++s) computed(seq_of(p, s));
        break;
      case GrpoMode::kFork:  // one prefill, then n - 1 forks sharing every block
        admit(seq_of(p, 0), prompts[p]);
        computed(seq_of(p, 0));
        for (int s = 1; s < kNumSamples; ++s) {
          cache.Fork(seq_of(p, 0), seq_of(p, s));
          tokens[seq_of(p, s)] = prompts[p];
        }
        break;
    }
    peak();
  }

  // Decode: one token per sample per step, generated blocks cached as they fill.
  for (int step = 0; step < kNumGenerated; ++step) {
    for (SeqId seq = 0; seq < kNumPrompts * kNumSamples; ++seq) {
      const AppendResult appended = cache.AppendSlots(seq, 1);
      Check(appended.ok(), "GRPO decode out of blocks");
      result.num_cow_copies += static_cast<std::int64_t>(appended.copies.size());
      tokens[seq].push_back(RandomTokens(rng, 1)[0]);
    }
    for (SeqId seq = 0; seq < kNumPrompts * kNumSamples; ++seq) computed(seq);
    peak();
  }
  cache.CheckIntegrity();
  const KvCacheStats stats = cache.stats();
  const std::int64_t looked_up = stats.num_prefix_hit_tokens + stats.num_prefix_miss_tokens;
  result.hit_rate = looked_up == 0 ? 0.0 : static_cast<double>(stats.num_prefix_hit_tokens) / looked_up;
  for (SeqId seq = 0; seq < kNumPrompts * kNumSamples; ++seq) cache.Release(seq);
  return result;
}

void Grpo() {
  std::printf("(b) GRPO: 64 prompts of 64-256 tokens, n = 8 samples each, 128 generated tokens, block %d\n\n",
              kBlockSize);
  std::printf("    %-40s %16s %9s %9s %11s %9s %10s\n", "mode", "prompt prefilled", "of prompt", "hit rate",
              "peak blocks", "peak GiB", "CoW copies");
  const struct {
    GrpoMode mode;
    const char* name;
  } modes[] = {
      {GrpoMode::kIndependent, "no prefix cache, no fork"},
      {GrpoMode::kCacheTogether, "prefix cache, n samples admitted at once"},
      {GrpoMode::kCacheFirstThenRest, "prefix cache, sample 0 first"},
      {GrpoMode::kFork, "fork n = 8 (+ prefix cache)"},
  };
  for (const auto& [mode, name] : modes) {
    const GrpoResult r = RunGrpo(mode);
    std::printf("    %-40s %16lld %8.1f%% %8.1f%% %11d %9.2f %10lld\n", name,
                static_cast<long long>(r.prefilled_tokens),
                100.0 * static_cast<double>(r.prefilled_tokens) / static_cast<double>(r.prompt_tokens),
                100.0 * r.hit_rate, r.peak_blocks,
                static_cast<double>(std::int64_t{r.peak_blocks} * kBlockSize * kBytesPerToken) / kGiB,
                static_cast<long long>(r.num_cow_copies));
  }
  std::printf("\n    hit rate: prompt tokens found cached at admission / prompt tokens admitted.\n");
  std::printf("    A fork admits the prompt once, so its hit rate is 0 while it prefills the least.\n");
}

}  // namespace

int main() {
  PagedVersusContiguous();
  Grpo();
  return 0;
}
