// Randomized test: thousands of random commands against KvCacheManager, checked after every step
// against an independent reference model and a simulated KV store.
//
// The simulated model runner writes, for token p of a sequence, the "KV" value
//   kv[p] = Mix(version computing it, kv[p - 1], token p)
// into slot p % B of physical block table[p / B]. The value depends on the whole prefix and on
// the weights' version, like real KV. So:
//   * every live sequence's blocks must hold exactly the values the reference model computed for
//     it (this catches a wrong or missing copy on write, a write into a shared block, a table
//     switched to a block with other content, and a block freed and reused while still held);
//   * every block a prefix match returns must hold the values a fresh computation of that prompt
//     under the current version would produce (this catches a stale-version or foreign block);
//   * a match returns only prefixes the model saw inserted under the current version, and at
//     least the prefix a live sequence pins (inserted blocks it holds cannot be evicted).
// Leaks and double frees: CheckIntegrity() after every step (and the pool aborts on a double free);
// at the end, releasing everything, evicting and reclaiming frees every block.

#include <algorithm>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include <gtest/gtest.h>

#include "tests/cache/cache_test_util.h"
#include "cache/kv_cache_manager.h"

namespace vroll::cache {
namespace {

std::uint64_t Mix(std::uint64_t version, std::uint64_t prev, TokenId token) {
  std::uint64_t x = prev ^ (version * 0x9E3779B97F4A7C15ull) ^ (static_cast<std::uint64_t>(token) << 17);
  x += 0x9E3779B97F4A7C15ull;  // splitmix64 finalizer
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
constexpr std::uint64_t kKvSeed = 0x5EEDull;

class KvCacheRandomizedTest : public ::testing::TestWithParam<std::tuple<std::int32_t, std::uint32_t>> {
 protected:
  static constexpr std::int32_t kNumBlocks = 48;
  static constexpr int kNumSteps = 4000;
  static constexpr std::size_t kMaxSeqs = 10;
  static constexpr TokenId kVocab = 3;  // tiny vocabulary: prompts share and diverge often

  struct RefSeq {
    std::vector<TokenId> tokens;       // every reserved slot is computed at once
    std::vector<std::uint64_t> kv;     // [tokens.size()] expected KV value per token
    PolicyVersion kv_version = 0;      // version at admission
    std::int32_t num_inserted_blocks = 0;
  };

  std::int32_t B() const { return std::get<0>(GetParam()); }

  void SetUp() override {
    rng_.seed(std::get<1>(GetParam()));
    KvCacheConfig config;
    config.num_blocks = kNumBlocks;
    config.block_size = B();
    config.watermark_blocks = 1;
    cache_ = std::make_unique<KvCacheManager>(config);
    kv_.assign(kNumBlocks, std::vector<std::uint64_t>(B(), 0));
    for (int i = 0; i < 4; ++i) stems_.push_back(RandomTokens(4 * B()));
  }

  void TearDown() override { cache_->CheckIntegrity(); }

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }  // [lo, hi]
  std::vector<TokenId> RandomTokens(int n) {
    std::vector<TokenId> tokens(n);
    for (TokenId& t : tokens) t = Uniform(0, kVocab - 1);
    return tokens;
  }
  SeqId RandomSeq() {
    auto it = seqs_.begin();
    std::advance(it, Uniform(0, static_cast<int>(seqs_.size()) - 1));
    return it->first;
  }
  std::vector<TokenId> RandomPrompt() {
    std::vector<TokenId> prompt;
    if (!seqs_.empty() && Uniform(0, 2) == 0) {  // continue a live sequence (generated blocks)
      const std::vector<TokenId>& tokens = seqs_.at(RandomSeq()).tokens;
      prompt = testing::Prefix(tokens, Uniform(0, static_cast<int>(tokens.size())));
    } else {
      prompt = testing::Prefix(stems_[Uniform(0, 3)], Uniform(0, 4 * B()));
    }
    prompt = testing::Concat(prompt, RandomTokens(Uniform(1, 2 * B())));
    if (prompt.size() > static_cast<std::size_t>(6 * B())) prompt.resize(6 * B());
    return prompt;
  }

  // Fresh computation of tokens[0, n) under the current version.
  std::vector<std::uint64_t> FreshKv(const std::vector<TokenId>& tokens, std::size_t n) const {
    std::vector<std::uint64_t> kv(n);
    std::uint64_t prev = kKvSeed;
    for (std::size_t p = 0; p < n; ++p) prev = kv[p] = Mix(version_, prev, tokens[p]);
    return kv;
  }

  void VerifyMatch(const std::vector<TokenId>& prompt, const std::vector<BlockId>& blocks) {
    const std::size_t n = blocks.size() * B();
    ASSERT_LE(blocks.size(), (prompt.size() - 1) / B()) << "match covers the whole prompt";
    if (blocks.empty()) return;
    ASSERT_EQ(inserted_.count(testing::Prefix(prompt, n)), 1u) << "matched a prefix never inserted at this version";
    const std::vector<std::uint64_t> fresh = FreshKv(prompt, n);
    for (std::size_t p = 0; p < n; ++p)
      ASSERT_EQ(kv_[blocks[p / B()]][p % B()], fresh[p]) << "matched block " << blocks[p / B()] << " slot " << p % B()
                                                          << " holds other KV";
  }

  // The simulated model runner computes tokens [from, size) of `seq` into its blocks.
  void Compute(SeqId seq, std::size_t from) {
    RefSeq& ref = seqs_.at(seq);
    const std::vector<BlockId>& table = cache_->BlockTable(seq);
    const RadixCache& radix = KvCacheTestPeer::radix(*cache_);
    ref.kv.resize(ref.tokens.size());
    for (std::size_t p = from; p < ref.tokens.size(); ++p) {
      const BlockId block = table[p / B()];
      if (p == from || p % B() == 0) {  // writing into `block`: nobody else may see it
        ASSERT_EQ(radix.node_of_block(block), kNoNode) << "write into cached block " << block;
        for (const auto& [other, unused] : seqs_) {
          if (other == seq) continue;
          const std::vector<BlockId>& other_table = cache_->BlockTable(other);
          ASSERT_EQ(std::count(other_table.begin(), other_table.end(), block), 0)
              << "seq " << seq << " writes block " << block << " shared with seq " << other;
        }
      }
      const std::uint64_t prev = p == 0 ? kKvSeed : ref.kv[p - 1];
      ref.kv[p] = kv_[block][p % B()] = Mix(version_, prev, ref.tokens[p]);
    }
  }

  void Insert(SeqId seq, std::int32_t num_computed) {
    RefSeq& ref = seqs_.at(seq);
    const std::int32_t num_new = cache_->InsertIntoPrefixCache(seq, ref.tokens, num_computed);
    ASSERT_GE(num_new, 0);
    if (ref.kv_version != version_) {
      ASSERT_EQ(num_new, 0) << "stale sequence inserted";
      return;
    }
    const std::int32_t num_full = num_computed / B();
    for (std::int32_t k = 1; k <= num_full; ++k) inserted_.insert(testing::Prefix(ref.tokens, k * B()));
    ref.num_inserted_blocks = std::max(ref.num_inserted_blocks, num_full);
  }

  // ---- Operations --------------------------------------------------------------------------

  void Admit() {
    if (seqs_.size() >= kMaxSeqs) return Release();
    const std::vector<TokenId> prompt = RandomPrompt();
    const bool can = cache_->CanAllocate(prompt);
    const KvCacheStats before = cache_->stats();
    const SeqId seq = next_seq_++;
    const AllocateResult result = cache_->Allocate(seq, prompt);
    ASSERT_EQ(result.ok(), can) << "CanAllocate and Allocate disagree";
    if (!result.ok()) {
      const KvCacheStats after = cache_->stats();
      ASSERT_FALSE(cache_->HasSequence(seq));
      ASSERT_EQ(after.num_free_blocks, before.num_free_blocks);
      ASSERT_EQ(after.num_cached_blocks, before.num_cached_blocks);
      ASSERT_EQ(after.num_retired_blocks, before.num_retired_blocks);
      ASSERT_EQ(after.num_prefix_miss_lookups, before.num_prefix_miss_lookups);
      return;
    }
    const std::vector<BlockId>& table = cache_->BlockTable(seq);
    ASSERT_EQ(result.num_cached_tokens % B(), 0);
    const std::vector<BlockId> matched = testing::Prefix(table, result.num_cached_tokens / B());
    VerifyMatch(prompt, matched);
    RefSeq& ref = seqs_[seq];
    ref.tokens = prompt;
    ref.kv_version = version_;
    ref.kv = FreshKv(prompt, result.num_cached_tokens);
    Compute(seq, result.num_cached_tokens);
    if (Uniform(0, 9) < 7) Insert(seq, static_cast<std::int32_t>(prompt.size()));
  }

  void Append() {
    if (seqs_.empty()) return Admit();
    const SeqId seq = RandomSeq();
    RefSeq& ref = seqs_.at(seq);
    const int n = Uniform(1, B() + 1);
    if (ref.tokens.size() + n > static_cast<std::size_t>(10 * B())) return Release();
    const bool can = cache_->CanAppendSlots(seq, n);
    const std::vector<BlockId> before = cache_->BlockTable(seq);
    const AppendResult result = cache_->AppendSlots(seq, n);
    ASSERT_EQ(result.ok(), can) << "CanAppendSlots and AppendSlots disagree";
    if (!result.ok()) {
      ASSERT_EQ(cache_->BlockTable(seq), before);
      ASSERT_EQ(cache_->num_tokens(seq), static_cast<std::int32_t>(ref.tokens.size()));
      return;
    }
    ASSERT_LE(result.copies.size(), 1u);
    for (const BlockCopy& copy : result.copies) {  // the model runner copies before the step
      ASSERT_NE(copy.src, copy.dst);
      ASSERT_EQ(before.back(), copy.src);
      ASSERT_EQ(cache_->BlockTable(seq)[before.size() - 1], copy.dst);
      kv_[copy.dst] = kv_[copy.src];
    }
    const std::size_t from = ref.tokens.size();
    const std::vector<TokenId> more = RandomTokens(n);
    ref.tokens.insert(ref.tokens.end(), more.begin(), more.end());
    Compute(seq, from);
    if (Uniform(0, 1) == 0) Insert(seq, static_cast<std::int32_t>(ref.tokens.size()));
  }

  void Fork() {
    if (seqs_.empty() || seqs_.size() >= kMaxSeqs) return;
    const SeqId parent = RandomSeq();
    const SeqId child = next_seq_++;
    cache_->Fork(parent, child);
    RefSeq copy = seqs_.at(parent);
    seqs_.emplace(child, std::move(copy));
  }

  void Release() {
    if (seqs_.empty()) return;
    const SeqId seq = RandomSeq();
    cache_->Release(seq);
    seqs_.erase(seq);
  }

  void InsertSome() {
    if (seqs_.empty()) return;
    const SeqId seq = RandomSeq();
    Insert(seq, Uniform(0, static_cast<int>(seqs_.at(seq).tokens.size())));
  }

  void MatchQuery() {
    const std::vector<TokenId> prompt = RandomPrompt();
    const PrefixMatch match = cache_->MatchPrefix(prompt);
    ASSERT_EQ(match.num_cached_tokens, static_cast<std::int32_t>(match.blocks.size()) * B());
    VerifyMatch(prompt, match.blocks);
  }

  void Evict() {
    const int n = Uniform(0, 3);
    const std::int32_t evicted = cache_->EvictCachedBlocks(n);
    ASSERT_LE(evicted, n);
    if (evicted < n) {
      ASSERT_EQ(cache_->stats().num_evictable_blocks, 0);
    }
  }

  void Reclaim() {
    const int n = Uniform(0, 3);
    ASSERT_LE(cache_->ReclaimRetired(n), n);
  }

  void Invalidate() {
    ++version_;
    cache_->Invalidate(version_);
    inserted_.clear();
  }

  // ---- Checks after every step ---------------------------------------------------------------

  void CheckAgainstModel() {
    cache_->CheckIntegrity();
    ASSERT_EQ(cache_->stats().num_sequences, static_cast<std::int32_t>(seqs_.size()));
    for (const auto& [seq, ref] : seqs_) {
      ASSERT_EQ(cache_->num_tokens(seq), static_cast<std::int32_t>(ref.tokens.size())) << "seq " << seq;
      const std::vector<BlockId>& table = cache_->BlockTable(seq);
      ASSERT_EQ(table.size(), (ref.tokens.size() + B() - 1) / B()) << "seq " << seq;
      for (std::size_t p = 0; p < ref.tokens.size(); ++p)
        ASSERT_EQ(kv_[table[p / B()]][p % B()], ref.kv[p]) << "seq " << seq << " token " << p << " in block "
                                                           << table[p / B()] << " lost its KV";
      // What a live current-version sequence inserted is pinned, so it must still match.
      if (ref.kv_version == version_ && ref.num_inserted_blocks > 0) {
        const PrefixMatch match = cache_->MatchPrefix(ref.tokens);
        const std::size_t expect = std::min<std::size_t>(ref.num_inserted_blocks, (ref.tokens.size() - 1) / B());
        ASSERT_GE(match.blocks.size(), expect) << "seq " << seq << ": its inserted blocks no longer match";
        VerifyMatch(ref.tokens, match.blocks);
      }
    }
  }

  std::mt19937_64 rng_;
  std::unique_ptr<KvCacheManager> cache_;
  std::vector<std::vector<std::uint64_t>> kv_;  // simulated KV store [num_blocks][B]
  std::vector<std::vector<TokenId>> stems_;     // shared prompt beginnings
  std::map<SeqId, RefSeq> seqs_;
  std::set<std::vector<TokenId>> inserted_;     // block-aligned prefixes inserted at version_
  PolicyVersion version_ = 0;
  SeqId next_seq_ = 0;
};

TEST_P(KvCacheRandomizedTest, MatchesReferenceModelAndNeverLeaks) {
  int num_ops[9] = {};
  for (int step = 0; step < kNumSteps; ++step) {
    const int r = Uniform(0, 99);
    int op;
    if (r < 22) op = 0;
    else if (r < 47) op = 1;
    else if (r < 55) op = 2;
    else if (r < 67) op = 3;
    else if (r < 77) op = 4;
    else if (r < 87) op = 5;
    else if (r < 93) op = 6;
    else if (r < 98) op = 7;
    else op = 8;
    static const char* const kNames[] = {"admit", "append", "fork", "release", "insert",
                                         "match", "evict", "reclaim", "invalidate"};
    SCOPED_TRACE(::testing::Message() << "step " << step << " (" << kNames[op] << ")");
    switch (op) {
      case 0: Admit(); break;
      case 1: Append(); break;
      case 2: Fork(); break;
      case 3: Release(); break;
      case 4: InsertSome(); break;
      case 5: MatchQuery(); break;
      case 6: Evict(); break;
      case 7: Reclaim(); break;
      default: Invalidate(); break;
    }
    ++num_ops[op];
    if (HasFatalFailure()) return;
    CheckAgainstModel();
    if (HasFatalFailure()) return;
  }

  const KvCacheStats stats = cache_->stats();
  // The run exercised what it claims to: hits, evictions, copies, reclaims, out-of-blocks.
  EXPECT_GT(stats.num_prefix_hit_lookups, 0);
  EXPECT_GT(stats.num_evicted_blocks, 0);
  EXPECT_GT(stats.num_reclaimed_blocks, 0);
  if (B() > 1) {
    EXPECT_GT(stats.num_cow_copies, 0);
  }
  EXPECT_GT(num_ops[8], 0);

  while (!seqs_.empty()) Release();
  cache_->CheckIntegrity();
  cache_->EvictCachedBlocks(std::numeric_limits<std::int32_t>::max());
  cache_->ReclaimRetired(std::numeric_limits<std::int32_t>::max());
  const KvCacheStats end = cache_->stats();
  EXPECT_EQ(end.num_free_blocks, kNumBlocks) << "leaked blocks";
  EXPECT_EQ(end.num_cached_blocks, 0);
  EXPECT_EQ(end.num_retired_blocks, 0);
}

INSTANTIATE_TEST_SUITE_P(BlockSizesAndSeeds, KvCacheRandomizedTest,
                         ::testing::Combine(::testing::Values(1, 4, 16), ::testing::Values(1u, 2u, 3u)),
                         [](const auto& info) {
                           return "B" + std::to_string(std::get<0>(info.param)) + "_seed" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace vroll::cache
