#include "cache/radix_cache.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include <xxhash.h>

#include "policy/check.h"

namespace vroll::cache {

std::uint64_t HashBlockTokens(const TokenId* tokens, std::int32_t num_tokens) {
  return XXH3_64bits(tokens, sizeof(TokenId) * static_cast<std::size_t>(num_tokens));
}

RadixCache::RadixCache(BlockPool* pool, std::int32_t block_size, PolicyVersion version, BlockHasher hasher)
    : pool_(pool), block_size_(block_size), hasher_(hasher), version_(version) {
  VROLL_CHECK(pool_ != nullptr, "RadixCache needs a block pool");
  VROLL_CHECK(block_size_ > 0, "RadixCache: block_size {} must be > 0", block_size_);
  VROLL_CHECK(hasher_ != nullptr, "RadixCache needs a hasher");
  node_of_block_.assign(pool_->num_blocks(), kNoNode);
  root_ = NewNode();
  nodes_[root_].version = version_;
}

NodeId RadixCache::NewNode() {
  NodeId id;
  if (!free_node_ids_.empty()) {
    id = free_node_ids_.back();
    free_node_ids_.pop_back();
  } else {
    id = static_cast<NodeId>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& node = nodes_[id];
  node.alive = true;
  node.parent = kNoNode;
  node.block = kNoBlock;
  node.hash = 0;
  node.last_access_tick = 0;
  node.num_pinned = 0;
  node.self_pinned = false;
  return id;
}

void RadixCache::FreeNode(NodeId id) {
  Node& node = nodes_[id];
  node.alive = false;
  node.parent = kNoNode;
  node.block = kNoBlock;
  node.tokens.clear();
  node.children.clear();
  free_node_ids_.push_back(id);
}

bool RadixCache::SameTokens(const Node& node, const TokenId* tokens) const {
  return std::equal(node.tokens.begin(), node.tokens.end(), tokens);
}

bool RadixCache::IsCurrentNode(NodeId node) const {
  return node >= 0 && node < static_cast<NodeId>(nodes_.size()) && nodes_[node].alive &&
         nodes_[node].version == version_;
}

bool RadixCache::IsLeafEvictable(NodeId id) const {
  const Node& node = nodes_[id];
  return id != root_ && node.children.empty() && node.num_pinned == 0;
}

NodeId RadixCache::node_of_block(BlockId block) const {
  VROLL_CHECK(block >= 0 && block < static_cast<BlockId>(node_of_block_.size()), "node_of_block: block id {} out of range",
              block);
  return node_of_block_[block];
}

RadixCache::Match RadixCache::MatchPrefix(const TokenId* tokens, std::int32_t max_blocks) const {
  Match match;
  NodeId cur = root_;
  for (std::int32_t j = 0; j < max_blocks; ++j) {
    const TokenId* block_tokens = tokens + static_cast<std::size_t>(j) * block_size_;
    const auto& children = nodes_[cur].children;
    const auto it = children.find(hasher_(block_tokens, block_size_));
    if (it == children.end() || !SameTokens(nodes_[it->second], block_tokens)) break;
    cur = it->second;
    match.blocks.push_back(nodes_[cur].block);
    if (nodes_[cur].num_pinned == 0) ++match.num_evictable;
  }
  match.last_node = cur;
  return match;
}

void RadixCache::Touch(NodeId id) {
  VROLL_CHECK(IsCurrentNode(id), "Touch: node {} is not in the current tree", id);
  const std::uint64_t tick = ++clock_;
  for (NodeId n = id; n != kNoNode; n = nodes_[n].parent) {
    Node& node = nodes_[n];
    if (IsLeafEvictable(n)) {
      lru_.erase({node.last_access_tick, n});
      lru_.insert({tick, n});
    }
    node.last_access_tick = tick;
  }
}

RadixCache::InsertResult RadixCache::Insert(NodeId parent, const TokenId* tokens, const BlockId* blocks,
                                            std::int32_t num_blocks) {
  VROLL_CHECK(IsCurrentNode(parent), "Insert: parent node {} is not in the current tree", parent);
  InsertResult result;
  NodeId cur = parent;
  for (std::int32_t j = 0; j < num_blocks; ++j) {
    const TokenId* block_tokens = tokens + static_cast<std::size_t>(j) * block_size_;
    const std::uint64_t hash = hasher_(block_tokens, block_size_);
    const auto it = nodes_[cur].children.find(hash);
    if (it != nodes_[cur].children.end()) {
      if (!SameTokens(nodes_[it->second], block_tokens)) break;  // collision: leave the rest uncached
      cur = it->second;
    } else {
      const BlockId block = blocks[j];
      VROLL_CHECK(pool_->ref_count(block) >= 1, "Insert: block {} is free", block);
      VROLL_CHECK(node_of_block_[block] == kNoNode, "Insert: block {} is already indexed by node {}", block,
                  node_of_block_[block]);
      // The parent stops being a leaf; a new unpinned leaf takes its place in the LRU set.
      if (IsLeafEvictable(cur)) lru_.erase({nodes_[cur].last_access_tick, cur});
      const NodeId id = NewNode();  // may reallocate nodes_: take references only after this
      Node& node = nodes_[id];
      node.parent = cur;
      node.block = block;
      node.version = version_;
      node.hash = hash;
      node.last_access_tick = clock_;
      node.tokens.assign(block_tokens, block_tokens + block_size_);
      nodes_[cur].children.emplace(hash, id);
      node_of_block_[block] = id;
      pool_->IncRef(block);  // the tree's own reference: used(ref=r) -> cached, used(ref=r+1)
      pool_->SetBlockVersion(block, version_);
      ++num_cached_blocks_;
      ++num_evictable_;
      ++num_self_unpinned_;
      lru_.insert({node.last_access_tick, id});
      SetSelfPinned(id, pool_->ref_count(block) > 1);
      ++result.num_new_nodes;
      cur = id;
    }
    result.blocks.push_back(nodes_[cur].block);
    ++result.num_blocks;
  }
  result.last_node = cur;
  return result;
}

void RadixCache::OnRefCountChanged(BlockId block) {
  const NodeId id = node_of_block(block);
  if (id == kNoNode) return;
  const std::int32_t ref = pool_->ref_count(block);
  VROLL_CHECK(ref >= 1, "block {} indexed by node {} has ref_count {}", block, id, ref);
  SetSelfPinned(id, ref > 1);
}

void RadixCache::SetSelfPinned(NodeId id, bool pinned) {
  Node& node = nodes_[id];
  if (node.self_pinned == pinned) return;
  node.self_pinned = pinned;
  if (node.version != version_) {  // retired: only the reclaimable count cares
    num_retired_unpinned_ += pinned ? -1 : 1;
    return;
  }
  num_self_unpinned_ += pinned ? -1 : 1;
  AddPinned(id, pinned ? 1 : -1);
}

void RadixCache::AddPinned(NodeId id, int delta) {
  // Propagate while a node's num_pinned crosses zero: only then does its parent's count change.
  for (NodeId n = id; n != kNoNode; n = nodes_[n].parent) {
    Node& node = nodes_[n];
    const bool was_zero = node.num_pinned == 0;
    node.num_pinned += delta;
    VROLL_CHECK(node.num_pinned >= 0, "node {}: num_pinned went negative", n);
    const bool is_zero = node.num_pinned == 0;
    if (was_zero == is_zero || n == root_) return;
    if (is_zero) {
      ++num_evictable_;
      if (node.children.empty()) lru_.insert({node.last_access_tick, n});
    } else {
      --num_evictable_;
      lru_.erase({node.last_access_tick, n});
    }
  }
}

std::optional<BlockId> RadixCache::EvictOne() {
  if (lru_.empty()) return std::nullopt;
  const NodeId id = lru_.begin()->second;
  lru_.erase(lru_.begin());
  Node& node = nodes_[id];
  const BlockId block = node.block;
  VROLL_CHECK(node.children.empty() && node.num_pinned == 0,
              "EvictOne: LRU node {} (block {}) is not an unpinned leaf", id, block);
  const NodeId parent = node.parent;
  nodes_[parent].children.erase(node.hash);
  node_of_block_[block] = kNoNode;
  --num_cached_blocks_;
  --num_evictable_;
  --num_self_unpinned_;
  FreeNode(id);
  VROLL_CHECK(pool_->DecRef(block), "EvictOne: block {} of unpinned leaf {} was not freed", block, id);
  if (IsLeafEvictable(parent)) lru_.insert({nodes_[parent].last_access_tick, parent});
  return block;
}

void RadixCache::Invalidate(PolicyVersion new_version) {
  VROLL_CHECK(new_version > version_, "Invalidate: new version {} must be > current {}", new_version, version_);
  if (nodes_[root_].children.empty()) {  // nothing cached: keep the empty root
    nodes_[root_].version = new_version;
    version_ = new_version;
    return;
  }
  RetiredTree retired;
  retired.version = version_;
  retired.pending.push_back(root_);
  retired.lru = std::exchange(lru_, {});
  retired_.push_back(std::move(retired));
  num_retired_blocks_ += num_cached_blocks_;
  num_retired_unpinned_ += num_self_unpinned_;
  num_cached_blocks_ = 0;
  num_evictable_ = 0;
  num_self_unpinned_ = 0;
  version_ = new_version;
  root_ = NewNode();
  nodes_[root_].version = version_;
}

std::int32_t RadixCache::ReclaimRetired(std::int32_t max_nodes) {
  std::int32_t num_reclaimed = 0;
  while (!retired_.empty()) {
    RetiredTree& tree = retired_.front();
    if (tree.pending.empty()) {
      VROLL_CHECK(tree.lru.empty(), "retired tree of version {} reclaimed with {} LRU entries left", tree.version,
                  tree.lru.size());
      retired_.pop_front();
      continue;
    }
    if (num_reclaimed >= max_nodes) break;
    const NodeId id = tree.pending.back();
    tree.pending.pop_back();
    Node& node = nodes_[id];
    for (const auto& [hash, child] : node.children) {
      nodes_[child].parent = kNoNode;
      tree.pending.push_back(child);
    }
    if (node.block != kNoBlock) {
      tree.lru.erase({node.last_access_tick, id});
      --num_retired_blocks_;
      if (!node.self_pinned) --num_retired_unpinned_;
      node_of_block_[node.block] = kNoNode;
      pool_->DecRef(node.block);  // retired(ref=1) -> free; still in a block table -> used
      ++num_reclaimed;
    }
    FreeNode(id);
  }
  return num_reclaimed;
}

std::vector<BlockId> RadixCache::PathBlocks(NodeId id) const {
  VROLL_CHECK(IsCurrentNode(id), "PathBlocks: node {} is not in the current tree", id);
  std::vector<BlockId> blocks;
  for (NodeId n = id; n != root_; n = nodes_[n].parent) {
    VROLL_CHECK(n != kNoNode, "PathBlocks: node {} does not reach the current root", id);
    blocks.push_back(nodes_[n].block);
  }
  std::reverse(blocks.begin(), blocks.end());
  return blocks;
}

void RadixCache::AddHolderCounts(std::vector<std::int32_t>* counts) const {
  for (const Node& node : nodes_) {
    if (node.alive && node.block != kNoBlock) ++(*counts)[node.block];
  }
}

void RadixCache::CheckIntegrity() const {
  const NodeId num_nodes = static_cast<NodeId>(nodes_.size());
  VROLL_CHECK(root_ >= 0 && root_ < num_nodes && nodes_[root_].alive, "current root {} is not a live node", root_);
  {
    const Node& root = nodes_[root_];
    VROLL_CHECK(root.block == kNoBlock && root.parent == kNoNode, "current root {} has a block or a parent", root_);
    VROLL_CHECK(root.version == version_, "current root {} has version {} != tree version {}", root_, root.version,
                version_);
  }

  // Tops of retired trees: nodes whose parent has been reclaimed.
  std::unordered_set<NodeId> retired_tops;
  for (const RetiredTree& tree : retired_) {
    VROLL_CHECK(tree.version < version_, "retired tree version {} is not older than current {}", tree.version,
                version_);
    for (const NodeId id : tree.pending) {
      VROLL_CHECK(id >= 0 && id < num_nodes && nodes_[id].alive, "retired pending node {} is not live", id);
      VROLL_CHECK(nodes_[id].version == tree.version, "retired node {} has version {} != its tree's {}", id,
                  nodes_[id].version, tree.version);
      VROLL_CHECK(retired_tops.insert(id).second, "retired node {} is pending twice", id);
    }
    for (const auto& [tick, id] : tree.lru) {
      VROLL_CHECK(id >= 0 && id < num_nodes && nodes_[id].alive && nodes_[id].version == tree.version,
                  "retired LRU entry for node {} does not name a live node of version {}", id, tree.version);
    }
  }

  std::int32_t num_cached = 0, num_evictable = 0, num_self_unpinned = 0, num_retired = 0, num_retired_unpinned = 0;
  std::int32_t num_lru = 0, num_live = 0;
  for (NodeId id = 0; id < num_nodes; ++id) {
    const Node& node = nodes_[id];
    if (!node.alive) continue;
    ++num_live;
    const bool current = node.version == version_;
    VROLL_CHECK(node.version <= version_, "node {} has version {} newer than the tree's {}", id, node.version,
                version_);

    // Links.
    if (node.parent == kNoNode) {
      VROLL_CHECK(id == root_ || retired_tops.count(id) == 1, "node {} has no parent and is neither a root nor pending",
                  id);
    } else {
      VROLL_CHECK(node.parent >= 0 && node.parent < num_nodes && nodes_[node.parent].alive,
                  "node {}: parent {} is not a live node", id, node.parent);
      const Node& parent = nodes_[node.parent];
      const auto it = parent.children.find(node.hash);
      VROLL_CHECK(it != parent.children.end() && it->second == id, "node {}: parent {} does not list it as a child",
                  id, node.parent);
      VROLL_CHECK(parent.version == node.version, "node {} (version {}) and its parent {} (version {}) differ", id,
                  node.version, node.parent, parent.version);
    }
    std::int32_t num_pinned_children = 0;
    for (const auto& [hash, child] : node.children) {
      VROLL_CHECK(child >= 0 && child < num_nodes && nodes_[child].alive, "node {}: child {} is not a live node", id,
                  child);
      VROLL_CHECK(nodes_[child].parent == id, "node {}: child {} names parent {}", id, child, nodes_[child].parent);
      VROLL_CHECK(nodes_[child].hash == hash, "node {}: child {} is keyed by a hash that is not its own", id, child);
      if (nodes_[child].num_pinned > 0) ++num_pinned_children;
    }

    if (node.block == kNoBlock) {
      VROLL_CHECK(node.parent == kNoNode, "node {} has no block but is not a root", id);
      continue;
    }

    // Block.
    const BlockId block = node.block;
    VROLL_CHECK(block >= 0 && block < pool_->num_blocks(), "node {}: block id {} out of range", id, block);
    VROLL_CHECK(!pool_->is_free(block), "block {} is free but indexed by node {}", block, id);
    VROLL_CHECK(node_of_block_[block] == id, "node {} indexes block {} but the block map says node {}", id, block,
                node_of_block_[block]);
    VROLL_CHECK(pool_->block_version(block) == node.version, "node {} (block {}): block version {} != tree version {}",
                id, block, pool_->block_version(block), node.version);
    VROLL_CHECK(static_cast<std::int32_t>(node.tokens.size()) == block_size_, "node {} (block {}) holds {} tokens",
                id, block, node.tokens.size());
    VROLL_CHECK(hasher_(node.tokens.data(), block_size_) == node.hash, "node {} (block {}): stale hash", id, block);
    VROLL_CHECK(node.self_pinned == (pool_->ref_count(block) > 1), "node {} (block {}): self_pinned {} but ref_count {}",
                id, block, node.self_pinned, pool_->ref_count(block));

    if (current) {
      ++num_cached;
      if (!node.self_pinned) ++num_self_unpinned;
      const std::int32_t expect_pinned = (node.self_pinned ? 1 : 0) + num_pinned_children;
      VROLL_CHECK(node.num_pinned == expect_pinned, "node {} (block {}): num_pinned {} != recount {}", id, block,
                  node.num_pinned, expect_pinned);
      if (node.num_pinned == 0) ++num_evictable;
      const bool in_lru = lru_.count({node.last_access_tick, id}) == 1;
      VROLL_CHECK(in_lru == IsLeafEvictable(id), "node {} (block {}): {} the LRU set but {} an unpinned leaf", id,
                  block, in_lru ? "in" : "not in", IsLeafEvictable(id) ? "is" : "is not");
      if (in_lru) ++num_lru;
    } else {
      ++num_retired;
      if (!node.self_pinned) ++num_retired_unpinned;
    }
  }

  for (BlockId block = 0; block < static_cast<BlockId>(node_of_block_.size()); ++block) {
    const NodeId id = node_of_block_[block];
    if (id == kNoNode) continue;
    VROLL_CHECK(id >= 0 && id < num_nodes && nodes_[id].alive && nodes_[id].block == block,
                "block map says block {} is indexed by node {}, which does not hold it", block, id);
  }

  VROLL_CHECK(num_lru == static_cast<std::int32_t>(lru_.size()), "LRU set has {} entries, {} unpinned leaves",
              lru_.size(), num_lru);
  VROLL_CHECK(num_cached == num_cached_blocks_, "num_cached_blocks {} != recount {}", num_cached_blocks_, num_cached);
  VROLL_CHECK(num_evictable == num_evictable_, "num_evictable {} != recount {}", num_evictable_, num_evictable);
  VROLL_CHECK(num_self_unpinned == num_self_unpinned_, "num_self_unpinned {} != recount {}", num_self_unpinned_,
              num_self_unpinned);
  VROLL_CHECK(num_retired == num_retired_blocks_, "num_retired_blocks {} != recount {}", num_retired_blocks_,
              num_retired);
  VROLL_CHECK(num_retired_unpinned == num_retired_unpinned_, "num_retired_unpinned {} != recount {}",
              num_retired_unpinned_, num_retired_unpinned);

  // Reachability: every live node hangs below the current root or a retired tree's pending node.
  std::vector<NodeId> stack(retired_tops.begin(), retired_tops.end());
  stack.push_back(root_);
  std::vector<bool> seen(nodes_.size(), false);
  std::int32_t num_reached = 0;
  while (!stack.empty()) {
    const NodeId id = stack.back();
    stack.pop_back();
    VROLL_CHECK(!seen[id], "node {} is reachable twice (cycle or shared child)", id);
    seen[id] = true;
    ++num_reached;
    for (const auto& [hash, child] : nodes_[id].children) stack.push_back(child);
  }
  VROLL_CHECK(num_reached == num_live, "{} live nodes but {} reachable from the roots", num_live, num_reached);
}

}  // namespace vroll::cache
