#include "cache/paged_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include "cache/attention_kernel.h"
#include "cache/block_pool.h"
#include "policy/check.h"
#include "policy/huge_pages.h"
#include "policy/logging.h"

namespace vroll::cache {

namespace {

at::ScalarType StorageType(KvCacheDtype dtype) {
  switch (dtype) {
    case KvCacheDtype::kFloat16: return at::kHalf;
    case KvCacheDtype::kBFloat16: return at::kBFloat16;
    default: return at::kFloat;
  }
}

}  // namespace

PagedKvCache::PagedKvCache(const policy::ModelConfig& config, int num_blocks, int block_size, KvCacheDtype dtype)
    : config_(config), num_blocks_(num_blocks), block_size_(block_size), dtype_(dtype) {
  c10::InferenceMode guard;
  if (num_blocks <= 0) throw std::invalid_argument(fmt::format("PagedKvCache: num_blocks = {} must be > 0", num_blocks));
  if (block_size <= 0) throw std::invalid_argument(fmt::format("PagedKvCache: block_size = {} must be > 0", block_size));
  const int64_t bytes = BytesPerBlock(config, block_size, dtype) * num_blocks;
  auto cannot_allocate = [&](const char* what) {
    return std::runtime_error(fmt::format(
        "paged KV cache: cannot allocate {} blocks x {} tokens, {:.1f} MiB of {} keys and values (the engine's "
        "kv_cache_bytes; vroll-worker --kv-cache-mb): {}",
        num_blocks, block_size, bytes / 1048576.0, KvCacheDtypeName(dtype), what));
  };
  try {
    // On transparent huge pages: attention reads each block's keys and values (18 KiB per layer
    // for the 15M shape) from anywhere in the pool, and with 4 KiB pages each of those pieces
    // crossed 5 pages (TLB misses; the hardware prefetchers stop at page boundaries).
    for (int l = 0; l < config.n_layers; ++l) {
      k_.push_back(policy::ZerosOnHugePages({num_blocks, block_size, config.n_kv_heads, config.head_dim()},
                                            StorageType(dtype)));
      v_.push_back(policy::ZerosOnHugePages({num_blocks, block_size, config.n_kv_heads, config.head_dim()},
                                            StorageType(dtype)));
    }
  } catch (const c10::Error& e) {  // e.g. the allocator's "can't allocate memory"
    throw cannot_allocate(e.what_without_backtrace());
  } catch (const std::bad_alloc& e) {
    throw cannot_allocate(e.what());
  }
  Logger("cache").info("paged KV storage: {} blocks x {} tokens, {:.1f} MiB of {} ({} bytes per block)", num_blocks,
                       block_size, bytes / 1048576.0, KvCacheDtypeName(dtype), BytesPerBlock(config, block_size, dtype));
}

int64_t PagedKvCache::BytesPerBlock(const policy::ModelConfig& config, int block_size, KvCacheDtype dtype) {
  return KvBytesPerBlock(config.n_layers, config.n_kv_heads, config.head_dim(), block_size, KvCacheDtypeBytes(dtype));
}

void PagedKvCache::SetStep(PagedStepLayout layout) {
  const size_t num_seqs = layout.context_lens.size();
  if (layout.query_start.size() != num_seqs + 1 || layout.block_table_start.size() != num_seqs + 1 ||
      layout.query_start.front() != 0 || layout.block_table_start.front() != 0 ||
      layout.block_table_start.back() != static_cast<int32_t>(layout.block_ids.size())) {
    throw std::invalid_argument(fmt::format(
        "PagedKvCache::SetStep: inconsistent layout ({} context_lens, {} query_start, {} block_table_start, {} block_ids)",
        num_seqs, layout.query_start.size(), layout.block_table_start.size(), layout.block_ids.size()));
  }
  row_seq_.assign(layout.query_start.back(), 0);
  for (size_t s = 0; s < num_seqs; ++s) {
    const int32_t n_new = layout.query_start[s + 1] - layout.query_start[s];
    const int32_t ctx = layout.context_lens[s];
    const int32_t num_table = layout.block_table_start[s + 1] - layout.block_table_start[s];
    if (n_new <= 0 || ctx < n_new || ctx > config_.max_seq_len) {
      throw std::invalid_argument(fmt::format("PagedKvCache::SetStep: sequence {} has {} new tokens, context_len {}",
                                              s, n_new, ctx));
    }
    if (static_cast<int64_t>(num_table) * block_size_ < ctx) {
      throw std::invalid_argument(fmt::format(
          "PagedKvCache::SetStep: sequence {} has {} blocks of {} tokens for context_len {}", s, num_table, block_size_, ctx));
    }
    std::fill(row_seq_.begin() + layout.query_start[s], row_seq_.begin() + layout.query_start[s + 1],
              static_cast<int32_t>(s));
  }
  for (int32_t b : layout.block_ids) {
    if (b < 0 || b >= num_blocks_) {
      throw std::invalid_argument(fmt::format("PagedKvCache::SetStep: block id {} outside [0, {})", b, num_blocks_));
    }
  }
  // A block that a sequence writes this step must be in no other sequence's table: its other
  // readers would see this step's keys in slots past their own context (a 16-bit cache converts
  // whole blocks), and AttendRows runs sequences on several threads at once. The scheduler's
  // copy-on-write guarantees it (a forked sample copies a shared last block before writing).
  if (writer_.size() != static_cast<size_t>(num_blocks_)) writer_.assign(static_cast<size_t>(num_blocks_), -1);
  std::vector<int32_t> written;  // reset to -1 on the way out, so the scratch stays all -1
  auto check = [&] {
    for (size_t s = 0; s < num_seqs; ++s) {
      const int32_t n_new = layout.query_start[s + 1] - layout.query_start[s];
      const int32_t* table = layout.block_ids.data() + layout.block_table_start[s];
      const int32_t first = (layout.context_lens[s] - n_new) / block_size_;
      const int32_t last = (layout.context_lens[s] - 1) / block_size_;
      for (int32_t j = first; j <= last; ++j) {
        if (writer_[table[j]] >= 0 && writer_[table[j]] != static_cast<int32_t>(s)) {
          throw std::invalid_argument(fmt::format("PagedKvCache::SetStep: sequences {} and {} both write block {}",
                                                  writer_[table[j]], s, table[j]));
        }
        writer_[table[j]] = static_cast<int32_t>(s);
        written.push_back(table[j]);
      }
    }
    for (size_t s = 0; s < num_seqs; ++s) {
      const int32_t num_read = (layout.context_lens[s] + block_size_ - 1) / block_size_;
      const int32_t* table = layout.block_ids.data() + layout.block_table_start[s];
      for (int32_t j = 0; j < num_read; ++j) {
        if (writer_[table[j]] >= 0 && writer_[table[j]] != static_cast<int32_t>(s)) {
          throw std::invalid_argument(fmt::format(
              "PagedKvCache::SetStep: sequence {} writes block {}, which sequence {} reads in the same step",
              writer_[table[j]], table[j], s));
        }
      }
    }
  };
  try {
    check();
  } catch (...) {
    for (int32_t b : written) writer_[b] = -1;
    throw;
  }
  for (int32_t b : written) writer_[b] = -1;
  layout_ = std::move(layout);
}

void PagedKvCache::SetVersionCheck(const std::vector<PolicyVersion>* block_versions, PolicyVersion expected) {
  block_versions_ = block_versions;
  expected_version_ = expected;
}

void PagedKvCache::CopyBlocks(const std::vector<std::pair<int32_t, int32_t>>& src_dst) {
  c10::InferenceMode guard;
  for (const auto& [src, dst] : src_dst) {
    VROLL_CHECK(src >= 0 && src < num_blocks_ && dst >= 0 && dst < num_blocks_, "CopyBlocks {} -> {}", src, dst);
    for (int l = 0; l < config_.n_layers; ++l) {
      k_[l][dst].copy_(k_[l][src]);
      v_[l][dst].copy_(v_[l][src]);
    }
  }
}

namespace {

/// Per-thread scratch of the 16-bit path, kept across calls (the OpenMP pool's threads persist):
/// the group's blocks converted to fp32, and the renumbering of its block tables.
struct SixteenBitScratch {
  std::vector<float> k, v;
  std::vector<int32_t> local_of;  // [num_blocks]: local index of a physical block in this group, or -1
  std::vector<int32_t> physical;  // local index -> physical block
  std::vector<int32_t> tables;    // the rows' renumbered tables, concatenated
  std::vector<kernels::TokenRow> rows;
};

}  // namespace

void PagedKvCache::AttendSixteenBit(const kernels::TokenRow* rows, int64_t count, int32_t shared_keys,
                                    const uint8_t* k_store, const uint8_t* v_store, float scale,
                                    std::vector<float>& scores) const {
  // A group's blocks, each once (the shared prefix, and any block two rows have in common),
  // converted to fp32 exactly (ConvertKvToFloat), then the same fp32 kernel over the scratch with
  // the tables renumbered: bit for bit an fp32 cache holding the same values. A group whose
  // blocks would take more than kMaxScratchBytes of fp32 runs row by row instead (each row's
  // own blocks only), so the scratch stays near one sequence's fp32 keys and values.
  // Where the kernel converts in registers (AVX-512F, tiled head sizes), no scratch at all.
  constexpr int64_t kMaxScratchBytes = int64_t{32} << 20;
  const int n_kv = config_.n_kv_heads, head_dim = config_.head_dim(), group = config_.n_heads / n_kv;
  const int64_t token_stride = int64_t{n_kv} * head_dim, block_stride = token_stride * block_size_;
  if (kernels::AttendTokensSixteenBit(dtype_, rows, static_cast<int>(count), shared_keys, n_kv, group, head_dim,
                                      block_size_, k_store, v_store, block_stride, token_stride, scale,
                                      scores.data())) {
    return;
  }
  thread_local SixteenBitScratch s;
  const int64_t elem = KvCacheDtypeBytes(dtype_);
  if (static_cast<int64_t>(s.local_of.size()) < num_blocks_) s.local_of.resize(num_blocks_, -1);
  int64_t num_group_blocks = 0;  // an upper bound: blocks counted per row
  for (int64_t r = 0; r < count; ++r) num_group_blocks += (rows[r].num_keys + block_size_ - 1) / block_size_;
  if (count > 1 && num_group_blocks * block_stride * 8 > kMaxScratchBytes) {
    for (int64_t r = 0; r < count; ++r) AttendSixteenBit(rows + r, 1, 0, k_store, v_store, scale, scores);
    return;
  }
  s.physical.clear();
  s.tables.clear();
  // local_of must be all -1 again when this returns, also when an allocation below throws (the
  // engine survives a failed step, and a stale entry would map a block to another's scratch).
  struct ResetLocals {
    SixteenBitScratch& s;
    ~ResetLocals() {
      for (int32_t id : s.physical) s.local_of[id] = -1;
    }
  } reset_locals{s};
  std::vector<int64_t> table_start(count);
  for (int64_t r = 0; r < count; ++r) {
    table_start[r] = static_cast<int64_t>(s.tables.size());
    const int32_t num_row_blocks = (rows[r].num_keys + block_size_ - 1) / block_size_;
    for (int32_t b = 0; b < num_row_blocks; ++b) {
      const int32_t id = rows[r].table[b];
      if (s.local_of[id] < 0) {
        s.physical.push_back(id);  // first: ResetLocals clears exactly the ids listed here
        s.local_of[id] = static_cast<int32_t>(s.physical.size() - 1);
      }
      s.tables.push_back(s.local_of[id]);
    }
  }
  const size_t floats = s.physical.size() * static_cast<size_t>(block_stride);
  if (s.k.size() < floats) {
    s.k.resize(floats);
    s.v.resize(floats);
  }
  for (size_t j = 0; j < s.physical.size(); ++j) {
    const int64_t src = s.physical[j] * block_stride * elem;
    kernels::ConvertKvToFloat(dtype_, k_store + src, block_stride, s.k.data() + j * block_stride);
    kernels::ConvertKvToFloat(dtype_, v_store + src, block_stride, s.v.data() + j * block_stride);
  }
  s.rows.assign(rows, rows + count);
  for (int64_t r = 0; r < count; ++r) s.rows[r].table = s.tables.data() + table_start[r];
  // Shared blocks are the same physical blocks, so the same locals: shared_keys still holds.
  kernels::AttendTokens(s.rows.data(), static_cast<int>(count), shared_keys, n_kv, group, head_dim, block_size_,
                        s.k.data(), s.v.data(), block_stride, token_stride, scale, scores.data());
}

at::Tensor PagedKvCache::Attend(int layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  c10::InferenceMode guard;
  const int64_t num_tokens = q.size(0);
  if (num_tokens != static_cast<int64_t>(row_seq_.size()) || !q.is_cpu() || q.scalar_type() != at::kFloat ||
      !q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous()) {
    throw std::invalid_argument(fmt::format(
        "PagedKvCache::Attend: expects contiguous CPU fp32 q/k/v for the {} rows set by SetStep, got {} rows",
        row_seq_.size(), num_tokens));
  }
  at::Tensor out = at::empty({num_tokens, config_.n_heads, config_.head_dim()}, at::kFloat);
  AttendRange(layer, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), 0, num_tokens,
              out.data_ptr<float>());
  return out;
}

std::vector<int32_t> PagedKvCache::SequenceRowStarts() const { return layout_.query_start; }

std::vector<double> PagedKvCache::SequenceAttentionBytes() const {
  const double bytes_per_key = 2.0 * config_.kv_dim() * KvCacheDtypeBytes(dtype_);
  std::vector<double> out(layout_.context_lens.size());
  for (size_t s = 0; s < out.size(); ++s) {
    const double n_new = layout_.query_start[s + 1] - layout_.query_start[s], ctx = layout_.context_lens[s];
    out[s] = bytes_per_key * (n_new * ctx - n_new * (n_new - 1) / 2);  // keys ctx - n_new + 1 ... ctx
  }
  return out;
}

void PagedKvCache::AttendRows(int layer, const float* q, const float* k, const float* v, int64_t row_begin,
                              int64_t row_end, float* out) {
  c10::InferenceMode guard;
  const int64_t num_tokens = static_cast<int64_t>(row_seq_.size());
  auto is_start = [&](int64_t row) {
    return row == num_tokens ||
           (row >= 0 && row < num_tokens && layout_.query_start[row_seq_[row]] == static_cast<int32_t>(row));
  };
  if (!(row_begin < row_end) || !is_start(row_begin) || !is_start(row_end)) {
    throw std::invalid_argument(fmt::format(
        "PagedKvCache::AttendRows: rows [{}, {}) are not whole sequences of the {} rows set by SetStep", row_begin,
        row_end, num_tokens));
  }
  AttendRange(layer, q, k, v, row_begin, row_end, out);
}

void PagedKvCache::AttendRange(int layer, const float* q_ptr, const float* k_rows, const float* v_rows,
                               int64_t row_begin, int64_t row_end, float* out_ptr) {
  const int64_t num_tokens = row_end - row_begin;
  if (num_tokens <= 0) return;  // an empty step
  const int n_heads = config_.n_heads, n_kv = config_.n_kv_heads, head_dim = config_.head_dim();
  const int group = n_heads / n_kv;
  const int64_t token_stride = int64_t{n_kv} * head_dim;  // between positions within a block, elements
  const int64_t block_stride = token_stride * block_size_;
  const int64_t elem = KvCacheDtypeBytes(dtype_), token_bytes = token_stride * elem;
  uint8_t* k_store = static_cast<uint8_t*>(k_[layer].data_ptr());
  uint8_t* v_store = static_cast<uint8_t*>(v_[layer].data_ptr());
  // A 16-bit cache stores the new keys and values rounded to nearest even (LibTorch's conversion).
  // float16 saturates finite values at its largest finite value (+-65504) rather than becoming inf
  // (inf would turn the row's attention, and so its logprobs, into NaN). An inf or NaN computed in
  // fp32 stays one, so the row's logits are non-finite and its sample ends with an error, as with
  // the other dtypes (clamping inf too had turned such a model's output into normal-looking samples).
  auto stored = [&](const float* rows) {
    at::Tensor x = at::from_blob(const_cast<float*>(rows), {num_tokens, token_stride}, at::kFloat);
    if (dtype_ == KvCacheDtype::kFloat32) return x;
    if (dtype_ == KvCacheDtype::kFloat16) {
      // Plain loops, not LibTorch ops: a step stores 2 x n_layers of these small tensors, and
      // each op's dispatch cost more than the attention saved (0.7 s of GRPO on the 15M shape).
      const int64_t n = num_tokens * token_stride;
      int64_t saturated = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float a = std::fabs(rows[i]);
        saturated += a > 65504.0f && a != INFINITY;  // NaN compares false
      }
      if (saturated == 0) return x.to(at::kHalf);  // inf and NaN convert as they are
      num_saturated_.fetch_add(saturated, std::memory_order_relaxed);
      if (!warned_saturation_.exchange(true)) {
        Logger("cache").warn(
            "float16 KV cache: {} keys/values of layer {} lay beyond +-65504 and were saturated to it (first "
            "seen; later ones are only counted): this model's logprobs now differ from an fp32 recompute by more "
            "than rounding; a bfloat16 or float32 cache keeps fp32's range (docs/KV_CACHE.md)",
            saturated, layer);
      }
      at::Tensor clamped = x.clone();
      float* c = clamped.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) {
        if (std::fabs(c[i]) != INFINITY) c[i] = std::clamp(c[i], -65504.0f, 65504.0f);  // NaN stays NaN
      }
      return clamped.to(at::kHalf);
    }
    return x.to(at::kBFloat16);
  };
  const at::Tensor k_stored = stored(k_rows), v_stored = stored(v_rows);
  const uint8_t* k_new = static_cast<const uint8_t*>(k_stored.data_ptr());
  const uint8_t* v_new = static_cast<const uint8_t*>(v_stored.data_ptr());
  const int32_t* ids = layout_.block_ids.data();

  // 1. Store the new keys and values: row t of sequence s is position ctx - n_new + (t - start).
  const int32_t seq_begin = row_seq_[row_begin];
  const int32_t seq_end = row_seq_[row_end - 1] + 1;
  for (int32_t s = seq_begin; s < seq_end; ++s) {
    const int32_t start = layout_.query_start[s], n_new = layout_.query_start[s + 1] - start;
    const int32_t first_pos = layout_.context_lens[s] - n_new;
    const int32_t* table = ids + layout_.block_table_start[s];
    for (int32_t i = 0; i < n_new; ++i) {
      const int32_t p = first_pos + i;
      const int64_t offset = (table[p / block_size_] * block_stride + (p % block_size_) * token_stride) * elem;
      const int64_t row = start + i - row_begin;
      std::memcpy(k_store + offset, k_new + row * token_bytes, token_bytes);
      std::memcpy(v_store + offset, v_new + row * token_bytes, token_bytes);
    }
    if (block_versions_ != nullptr && layer == 0) {
      const int32_t num_blocks = (layout_.context_lens[s] + block_size_ - 1) / block_size_;
      for (int32_t b = 0; b < num_blocks; ++b) {
        VROLL_CHECK((*block_versions_)[table[b]] == expected_version_,
                    "attention over KV block {} written under policy version {}, but this step runs version {}",
                    table[b], (*block_versions_)[table[b]], expected_version_);
      }
    }
  }

  // 2. Attention. Rows that start with the same blocks (the samples of a GRPO group over their
  // prompt, the rows of one sequence's prefill chunk) form one work item, so that AttendTokens
  // reads those blocks once for all of them; other rows are items of their own. Rows are
  // independent (each writes its own output row), so grouping them never changes a result.
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<kernels::TokenRow> rows(num_tokens);
  int64_t work = 0;  // multiply-adds of q.k and p.v
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t s = row_seq_[row_begin + t];
    const int32_t n_new = layout_.query_start[s + 1] - layout_.query_start[s];
    const int32_t p = layout_.context_lens[s] - n_new + static_cast<int32_t>(row_begin + t - layout_.query_start[s]);
    rows[t] = {q_ptr + t * n_heads * head_dim, out_ptr + t * n_heads * head_dim, ids + layout_.block_table_start[s],
               p + 1};
    work += p + 1;
  }
  work *= int64_t{2} * n_heads * head_dim;
  // Rows by first block (stable: the samples of a group are not adjacent in the batch: forks
  // join the running list after the sequences already there), then runs of up to
  // kMaxGroupRows rows sharing at least one chunk of 16 keys with the run's first row.
  std::stable_sort(rows.begin(), rows.end(), [](const kernels::TokenRow& a, const kernels::TokenRow& b) {
    return a.table[0] < b.table[0];
  });
  constexpr int kMaxGroupRows = 16;
  std::vector<int64_t> group_start = {0};
  std::vector<int32_t> group_shared;  // shared keys of each group
  for (int64_t t = 0; t < num_tokens;) {
    int64_t end = t + 1;
    int32_t shared = rows[t].num_keys;
    while (end < num_tokens && end - t < kMaxGroupRows) {
      int32_t common = 0;  // leading block ids in common with the group's first row
      const int32_t limit = std::min(shared, rows[end].num_keys) / block_size_;
      while (common < limit && rows[end].table[common] == rows[t].table[common]) ++common;
      if (common * block_size_ < std::max(16, block_size_)) break;
      shared = common * block_size_;
      ++end;
    }
    group_start.push_back(end);
    group_shared.push_back(end - t > 1 ? shared : 0);
    t = end;
  }
  const int64_t num_groups = static_cast<int64_t>(group_shared.size());
  // Small steps run on the calling thread: waking a worker costs more than their attention.
  const int64_t grain = work < (int64_t{1} << 20) ? num_groups : 1;
  at::parallel_for(0, num_groups, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = group_start[g], count = group_start[g + 1] - first;
      int max_keys = 0;
      for (int64_t t = first; t < first + count; ++t) max_keys = std::max(max_keys, rows[t].num_keys);
      scores.resize(static_cast<size_t>(kernels::AttendTokensScratch(static_cast<int>(count), n_heads, max_keys)));
      if (dtype_ == KvCacheDtype::kFloat32) {
        kernels::AttendTokens(rows.data() + first, static_cast<int>(count), group_shared[g], n_kv, group, head_dim,
                              block_size_, reinterpret_cast<const float*>(k_store),
                              reinterpret_cast<const float*>(v_store), block_stride, token_stride, scale,
                              scores.data());
      } else {
        AttendSixteenBit(rows.data() + first, count, group_shared[g], k_store, v_store, scale, scores);
      }
    }
  });
}

}  // namespace vroll::cache
