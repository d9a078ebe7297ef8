#include "cache/block_pool.h"

#include <string>

#include "policy/check.h"

namespace vroll::cache {

std::int64_t NumBlocksForBudget(std::int64_t budget_bytes, std::int64_t bytes_per_block) {
  if (budget_bytes < 0)
    throw CacheUsageError("NumBlocksForBudget: budget_bytes = " + std::to_string(budget_bytes) + " must be >= 0");
  if (bytes_per_block <= 0)
    throw CacheUsageError("NumBlocksForBudget: bytes_per_block = " + std::to_string(bytes_per_block) +
                          " must be > 0");
  return budget_bytes / bytes_per_block;
}

std::int64_t KvBytesPerBlock(int num_layers, int num_kv_heads, int head_dim, int block_size, int dtype_bytes) {
  const struct {
    const char* name;
    int value;
  } args[] = {{"num_layers", num_layers},
              {"num_kv_heads", num_kv_heads},
              {"head_dim", head_dim},
              {"block_size", block_size},
              {"dtype_bytes", dtype_bytes}};
  for (const auto& arg : args) {
    if (arg.value <= 0)
      throw CacheUsageError(std::string("KvBytesPerBlock: ") + arg.name + " = " + std::to_string(arg.value) +
                            " must be > 0");
  }
  return std::int64_t{2} * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes;
}

BlockPool::BlockPool(std::int32_t num_blocks) {
  if (num_blocks <= 0)
    throw CacheUsageError("BlockPool: num_blocks = " + std::to_string(num_blocks) + " must be > 0");
  ref_counts_.assign(num_blocks, 0);
  versions_.assign(num_blocks, 0);
  for (BlockId b = 0; b < num_blocks; ++b) free_list_.push_back(b);
}

void BlockPool::CheckId(BlockId block, const char* op) const {
  VROLL_CHECK(block >= 0 && block < num_blocks(), "{}: block id {} out of range [0, {})", op, block, num_blocks());
}

std::optional<BlockId> BlockPool::Allocate(PolicyVersion version) {
  if (free_list_.empty()) return std::nullopt;
  const BlockId block = free_list_.front();
  free_list_.pop_front();
  VROLL_CHECK(ref_counts_[block] == 0, "Allocate: block {} on the free list has ref_count {}", block,
              ref_counts_[block]);
  ref_counts_[block] = 1;
  versions_[block] = version;
  return block;
}

void BlockPool::IncRef(BlockId block) {
  CheckId(block, "IncRef");
  VROLL_CHECK(ref_counts_[block] >= 1, "IncRef: block {} is free", block);
  ++ref_counts_[block];
}

bool BlockPool::DecRef(BlockId block) {
  CheckId(block, "DecRef");
  VROLL_CHECK(ref_counts_[block] >= 1, "DecRef: block {} is already free (double free)", block);
  if (--ref_counts_[block] > 0) return false;
  free_list_.push_back(block);
  return true;
}

void BlockPool::SetBlockVersion(BlockId block, PolicyVersion version) {
  CheckId(block, "SetBlockVersion");
  VROLL_CHECK(ref_counts_[block] >= 1, "SetBlockVersion: block {} is free", block);
  versions_[block] = version;
}

std::int32_t BlockPool::ref_count(BlockId block) const {
  CheckId(block, "ref_count");
  return ref_counts_[block];
}

PolicyVersion BlockPool::block_version(BlockId block) const {
  CheckId(block, "block_version");
  return versions_[block];
}

void BlockPool::CheckIntegrity() const {
  std::vector<std::int32_t> times_on_free_list(ref_counts_.size(), 0);
  for (const BlockId block : free_list_) {
    VROLL_CHECK(block >= 0 && block < num_blocks(), "free list holds block id {} out of range [0, {})", block,
                num_blocks());
    VROLL_CHECK(++times_on_free_list[block] == 1, "block {} appears more than once on the free list", block);
  }
  for (BlockId block = 0; block < num_blocks(); ++block) {
    VROLL_CHECK(ref_counts_[block] >= 0, "block {} has negative ref_count {}", block, ref_counts_[block]);
    const bool on_free_list = times_on_free_list[block] == 1;
    VROLL_CHECK(on_free_list == (ref_counts_[block] == 0), "block {}: ref_count {} but {} the free list", block,
                ref_counts_[block], on_free_list ? "on" : "not on");
  }
}

}  // namespace vroll::cache
