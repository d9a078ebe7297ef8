#include "rollout/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "cache/block_pool.h"
#include "policy/errors.h"
#include "policy/logging.h"
#include "rollout/model_runner.h"

namespace vroll::rollout {

namespace {

/// Calls a caller's callback (a result, an update's acknowledgement) on the engine thread. One
/// that throws is logged and ignored: the exception must not unwind the step loop between a
/// request's bookkeeping and its other deliveries, or leave an acknowledged update pending.
template <typename F, typename Arg>
void CallBack(const char* what, const F& callback, Arg&& arg) noexcept {
  try {
    callback(std::forward<Arg>(arg));
  } catch (const std::exception& e) {
    Logger("rollout").error("{} callback threw (ignored): {}", what, e.what());
  } catch (...) {
    Logger("rollout").error("{} callback threw a non-standard exception (ignored)", what);
  }
}

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

const char* InFlightModeName(InFlightMode mode) {
  switch (mode) {
    case InFlightMode::kDrain: return "drain";
    case InFlightMode::kAbort: return "abort";
    case InFlightMode::kRestart: return "restart";
    case InFlightMode::kContinue: return "continue";
  }
  return "unknown";
}

std::optional<InFlightMode> ParseInFlightMode(const std::string& name) {
  for (InFlightMode m : {InFlightMode::kDrain, InFlightMode::kAbort, InFlightMode::kRestart, InFlightMode::kContinue}) {
    if (name == InFlightModeName(m)) return m;
  }
  return std::nullopt;
}

void EngineConfig::Validate() const {
  auto fail = [](const std::string& msg) { throw policy::ConfigError("engine config: " + msg); };
  if (kv_cache_bytes <= 0) fail(fmt::format("kv_cache_bytes = {} must be > 0", kv_cache_bytes));
  if (block_size <= 0) fail(fmt::format("block_size = {} must be > 0", block_size));
  if (watermark_blocks < -1) fail(fmt::format("watermark_blocks = {} must be >= 0 (or -1: 1%)", watermark_blocks));
  if (max_num_seqs < 1) fail(fmt::format("max_num_seqs = {} must be >= 1", max_num_seqs));
  if (max_num_batched_tokens < 1) fail(fmt::format("max_num_batched_tokens = {} must be >= 1", max_num_batched_tokens));
  if (max_pending_requests < 1) fail(fmt::format("max_pending_requests = {} must be >= 1", max_pending_requests));
}

Engine::Engine(const policy::Checkpoint& checkpoint, const EngineConfig& config)
    : config_(config), model_config_(checkpoint.config), seed_state_(config.seed) {
  config_.Validate();
  model_config_.Validate("engine model config");
  // As cache::PagedKvCache::BytesPerBlock, without its LibTorch header.
  const int64_t bytes_per_block =
      cache::KvBytesPerBlock(model_config_.n_layers, model_config_.n_kv_heads, model_config_.head_dim(),
                             config_.block_size, cache::KvCacheDtypeBytes(config_.kv_cache_dtype));
  const int64_t num_blocks64 = config_.kv_cache_bytes / bytes_per_block;
  if (num_blocks64 < 2) {
    throw policy::ConfigError(fmt::format("engine config: kv_cache_bytes = {} holds {} blocks of {} bytes; need >= 2",
                                          config_.kv_cache_bytes, num_blocks64, bytes_per_block));
  }
  if (num_blocks64 > (int64_t{1} << 30)) {
    throw policy::ConfigError(fmt::format(
        "engine config: kv_cache_bytes = {} ({:.0f} MiB) holds {} blocks of {} bytes; a KV cache has at most 2^30 "
        "blocks ({:.0f} MiB here)", config_.kv_cache_bytes, config_.kv_cache_bytes / 1048576.0, num_blocks64,
        bytes_per_block, static_cast<double>(bytes_per_block) * (int64_t{1} << 30) / 1048576.0));
  }
  const int num_blocks = static_cast<int>(num_blocks64);
  if (config_.watermark_blocks >= num_blocks) {
    throw policy::ConfigError(fmt::format(
        "engine config: watermark_blocks = {} must be less than the KV cache's {} blocks (kv_cache_bytes = {} / {} "
        "bytes per block)", config_.watermark_blocks, num_blocks, config_.kv_cache_bytes, bytes_per_block));
  }
  runner_ = std::make_unique<ModelRunner>(
      checkpoint, ModelRunnerConfig{num_blocks, config_.block_size, config_.check_block_versions,
                                    config_.batch_invariant, config_.swap_weight_buffers,
                                    config_.prepack_weights, config_.kv_cache_dtype, config_.micro_batches});
  spare_buffers_ = runner_->StagingBuffers();
  cache::KvCacheConfig kv_config;
  kv_config.num_blocks = num_blocks;
  kv_config.block_size = config_.block_size;
  kv_config.enable_prefix_caching = config_.enable_prefix_caching;
  kv_config.watermark_blocks = config_.watermark_blocks >= 0 ? config_.watermark_blocks : num_blocks / 100;
  kv_config.bytes_per_block = bytes_per_block;
  kv_ = std::make_unique<cache::KvCacheManager>(kv_config);
  // The longest sequence the engine runs. A sequence is (re)admitted with the KV of all its tokens
  // (a preempted one recomputes prompt + output), which needs blocks beyond the watermark; one
  // longer than that could never be admitted, even alone, and would wait forever at the head of
  // the queue. So the context is capped at what the cache holds for one sequence (vLLM refuses
  // to start instead; here a small cache stays usable for shorter sequences).
  num_kv_blocks_ = num_blocks;
  const int64_t cache_tokens = int64_t{num_blocks - std::max(kv_config.watermark_blocks, 0)} * config_.block_size;
  max_model_len_ = static_cast<int>(std::min<int64_t>(model_config_.max_seq_len, cache_tokens));
  if (max_model_len_ < 2) {
    throw policy::ConfigError(fmt::format(
        "engine config: the KV cache ({} blocks x {} tokens, {} kept free as the watermark) holds {} tokens of one "
        "sequence; a sequence needs >= 2 (raise kv_cache_bytes or lower watermark_blocks)",
        num_blocks, config_.block_size, kv_config.watermark_blocks, cache_tokens));
  }
  if (max_model_len_ < model_config_.max_seq_len) {
    // Blocks for one full-context sequence plus the watermark (by default 1% of all blocks).
    const int64_t sequence_blocks = (int64_t{model_config_.max_seq_len} + config_.block_size - 1) / config_.block_size;
    int64_t blocks_needed = sequence_blocks + std::max(config_.watermark_blocks, 0);
    while (config_.watermark_blocks < 0 && blocks_needed - blocks_needed / 100 < sequence_blocks) ++blocks_needed;
    Logger("rollout").warn(
        "engine: the KV cache ({} blocks x {} tokens, {} kept free as the watermark) holds {} tokens of one sequence, "
        "less than the model's context of {}: sequences are capped at {} tokens (prompts must be shorter; "
        "generation ends with finish reason length there). The full context needs kv_cache_bytes >= {} "
        "(vroll-worker --kv-cache-mb {})",
        num_blocks, config_.block_size, kv_config.watermark_blocks, cache_tokens, model_config_.max_seq_len,
        max_model_len_, blocks_needed * bytes_per_block, (blocks_needed * bytes_per_block + 1048575) / 1048576);
  }
  SchedulerConfig sched;
  sched.max_num_seqs = config_.max_num_seqs;
  sched.max_num_batched_tokens = config_.max_num_batched_tokens;
  sched.max_model_len = max_model_len_;
  scheduler_ = std::make_unique<Scheduler>(sched, kv_.get());
  param_specs_ = runner_->ParamSpecs();
  counters_.num_blocks = num_blocks;
  PublishStats();
  Logger("rollout").info(
      "engine: {} KV blocks x {} tokens ({:.1f} MiB of {}, {:.1f} MiB of it on huge pages), max_num_seqs {}, "
      "max_num_batched_tokens {}, max_pending_requests {}, prefix caching {}, micro-batches {}, KV block version "
      "check {}; weight updates {}",
      num_blocks, config_.block_size, num_blocks * bytes_per_block / 1048576.0,
      cache::KvCacheDtypeName(config_.kv_cache_dtype), runner_->kv_huge_page_bytes() / 1048576.0, config_.max_num_seqs,
      config_.max_num_batched_tokens, config_.max_pending_requests, config_.enable_prefix_caching ? "on" : "off",
      config_.micro_batches ? "on" : "off", config_.check_block_versions ? "on" : "off",
      !config_.swap_weight_buffers ? "applied in place (copy + repack at the safe point)"
      : config_.prepack_weights    ? "staged in spare buffers, packed while staged, swapped"
                                   : "staged in spare buffers, swapped, repacked at the safe point");
}

Engine::~Engine() {
  Stop();
  // MakeStaging hands out shared_ptrs, so its bound staging may outlive the engine: cut it loose
  // from the spare buffers and the packing observer that die with it. An open transaction is
  // aborted; from then on the staging stages into buffers of its own.
  std::lock_guard<std::mutex> lock(staging_mu_);
  if (std::shared_ptr<policy::WeightUpdateStaging> staging = bound_staging_.lock()) {
    staging->Abort();
    staging->SetObserver(nullptr);
    staging->UseValueBuffers(std::vector<float*>(param_specs_.size(), nullptr));
  }
}

void Engine::Start() {
  std::lock_guard<std::mutex> own(caller_mu_);  // a step running on a caller's thread ends first
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (threaded_) return;
    stop_ = false;
    threaded_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
}

bool Engine::Threaded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return threaded_;
}

void Engine::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // The engine thread is gone: this thread owns the engine now. threaded_ stays set until every
  // unfinished request and update is answered, so that no other thread steps the engine (as
  // Generate and UpdateWeights do when it has no thread) or submits meanwhile; never started,
  // a step on another caller's thread ends first.
  {
    std::lock_guard<std::mutex> own(caller_mu_);
    AbortAll();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    threaded_ = false;
  }
}

void Engine::AbortAll() {
  DrainInbox();
  std::vector<std::string> ids;
  for (const auto& [id, state] : live_) ids.push_back(id);
  for (const std::string& id : ids) Emit(scheduler_->AbortRequest(id, FinishReason::kAborted));
  // A weight update submitted and not applied is refused, so that its submitter hears back and
  // may reuse its staging: one taken at a safe point (e.g. draining), then one still in the inbox.
  std::optional<PendingUpdate> inbox;
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbox.swap(update_inbox_);
  }
  for (std::optional<PendingUpdate>* pending : {&update_, &inbox}) {
    if (!pending->has_value()) continue;
    PendingUpdate u = std::move(**pending);
    pending->reset();
    RefuseUpdate(u, "engine stopped before the update was applied");
  }
}

std::string Engine::ContextMessage(size_t num_prompt_tokens) const {
  if (max_model_len_ == model_config_.max_seq_len) {
    return fmt::format("prompt has {} tokens; the model's context is {} (at least one must be generated)",
                       num_prompt_tokens, max_model_len_);
  }
  return fmt::format("prompt has {} tokens; the context is {} (at least one must be generated): the model's {}, "
                     "capped by the KV cache, which holds {} blocks of {} tokens",
                     num_prompt_tokens, max_model_len_, model_config_.max_seq_len, num_kv_blocks_,
                     config_.block_size);
}

SubmitStatus Engine::Validate(const Request& r) const {
  auto invalid = [](std::string msg) { return SubmitStatus{SubmitStatus::Code::kInvalid, std::move(msg)}; };
  if (r.request_id.empty()) return invalid("request_id is empty");
  if (r.prompt.empty()) return invalid("prompt is empty");
  const int vocab = model_config_.vocab_size;
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= vocab) {
      return invalid(fmt::format("prompt[{}] = {} outside the vocabulary [0, {})", i, r.prompt[i], vocab));
    }
  }
  if (static_cast<int>(r.prompt.size()) >= max_model_len_) {
    return invalid(ContextMessage(r.prompt.size()));
  }
  if (r.n < 1 || r.n > config_.max_num_seqs) {
    return invalid(fmt::format("n = {} must be in [1, max_num_seqs = {}]", r.n, config_.max_num_seqs));
  }
  try {
    r.sampling.Validate(vocab);
  } catch (const std::invalid_argument& e) {
    return invalid(e.what());
  }
  return {};
}

bool Engine::InFlight(const std::string& request_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_ids_.count(request_id) != 0;
}

SubmitStatus Engine::Submit(Request request, ResultCallback on_result) {
  SubmitStatus status = Validate(request);
  if (!status.ok()) return status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && threaded_) return {SubmitStatus::Code::kStopped, "engine is stopping"};
    // A duplicate id is the request's own error: named before overloaded, which clients retry.
    if (pending_ids_.count(request.request_id) != 0) {
      return {SubmitStatus::Code::kInvalid, fmt::format("request_id '{}' is already in flight", request.request_id)};
    }
    if (num_pending_ >= config_.max_pending_requests) {
      return {SubmitStatus::Code::kOverloaded,
              fmt::format("overloaded: {} requests pending (max_pending_requests)", num_pending_)};
    }
    const uint64_t submission = ++num_submissions_;
    pending_ids_[request.request_id] = submission;
    ++num_pending_;
    inbox_.push_back(Submitted{std::move(request), std::move(on_result), submission});
  }
  cv_.notify_all();
  return {};
}

void Engine::Abort(const std::string& request_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_ids_.find(request_id);
    if (it == pending_ids_.end()) return;  // finished (or never accepted): nothing to end
    abort_inbox_.emplace_back(request_id, it->second);
  }
  cv_.notify_all();
}

void Engine::DrainInbox() {
  std::vector<Submitted> inbox;
  std::vector<std::pair<std::string, uint64_t>> aborts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    inbox.swap(inbox_);
    aborts.swap(abort_inbox_);
  }
  for (Submitted& submitted : inbox) {
    auto state = std::make_shared<RequestState>();
    Request& request = submitted.request;
    state->seed = request.seed.has_value() ? *request.seed : SplitMix(seed_state_);
    state->submit_time = Clock::now();
    state->num_unfinished = request.n;
    state->submission = submitted.submission;
    state->request = std::move(request);
    const std::string id = state->request.request_id;
    live_[id] = state;
    callbacks_[id] = std::move(submitted.on_result);
    scheduler_->AddRequest(std::move(state));
  }
  for (const auto& [id, submission] : aborts) {
    // Only the submission the abort was meant for: that one may have finished since, and its
    // id been reused by a new request added above.
    auto live = live_.find(id);
    if (live == live_.end() || live->second->submission != submission) continue;
    Emit(scheduler_->AbortRequest(id, FinishReason::kAborted));
  }
}

void Engine::Emit(std::vector<SampleResult> results) {
  std::vector<std::pair<ResultCallback, SampleResult>> deliveries;
  deliveries.reserve(results.size());
  for (SampleResult& r : results) {
    // No output token to tag (a stop token not included, an abort before the first token): the
    // sample finished under the version in use now, not under "version 0".
    if (r.version_spans.empty()) r.policy_version = version_.load();
    const std::string id = r.request_id;
    ++counters_.num_finished_samples;
    ResultCallback callback;
    auto cb = callbacks_.find(id);
    if (cb != callbacks_.end()) callback = cb->second;
    auto live = live_.find(id);
    if (live != live_.end() && ++live->second->num_emitted >= live->second->request.n) {
      // The request is over: free its id before the caller hears of its last sample, so that a
      // caller who resubmits the same id at once is not refused as "already in flight".
      live_.erase(live);
      callbacks_.erase(id);
      std::lock_guard<std::mutex> lock(mu_);
      pending_ids_.erase(id);
      --num_pending_;
    }
    deliveries.emplace_back(std::move(callback), std::move(r));
  }
  // A caller that asks for stats() once it has its samples must find them counted (finished, no
  // longer running): publish before delivering.
  PublishStats();
  for (auto& [callback, result] : deliveries) {
    if (callback) CallBack("result", callback, std::move(result));
  }
}

void Engine::WarnOfNonFiniteLogits(const std::vector<SampleResult>& finished, PolicyVersion version) {
  if (nonfinite_warned_version_ == version + 1) return;  // once per policy version
  const auto bad = std::count_if(finished.begin(), finished.end(), [](const SampleResult& r) {
    return r.finish_reason == FinishReason::kError && r.error.rfind(kNonFiniteLogits, 0) == 0;
  });
  if (bad == 0) return;
  nonfinite_warned_version_ = version + 1;
  Logger("rollout").warn("policy version {} produces NaN or inf logits: {} sample(s) ended with finish reason error "
                         "this step, and so will every sample that meets them (warned once per version)",
                         version, bad);
}

template <class OnError>
std::optional<bool> Engine::StepOnCaller(OnError&& on_error) {
  std::lock_guard<std::mutex> own(caller_mu_);
  if (Threaded()) return std::nullopt;
  try {
    return StepOwned();
  } catch (const std::exception& e) {
    on_error(e);
    throw;
  }
}

bool Engine::Step() {
  const std::optional<bool> stepped = StepOnCaller([](const std::exception&) {});
  if (!stepped.has_value()) {
    throw std::logic_error("Engine::Step: the engine thread is running (Start was called); Step is for an engine "
                           "without it");
  }
  return *stepped;
}

bool Engine::StepOwned() {
  const auto t0 = Clock::now();
  DrainInbox();
  const bool admit_new = SafePoint();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (paused_) return false;
  }
  if (!scheduler_->HasWork()) return false;
  const PolicyVersion version = version_.load();

  auto seconds_since = [](Clock::time_point& mark) {
    const Clock::time_point now = Clock::now();
    const double s = std::chrono::duration<double>(now - mark).count();
    mark = now;
    return s;
  };
  Clock::time_point mark = Clock::now();
  StepPlan plan = scheduler_->Schedule(version, admit_new ? Scheduler::Admission::kAll
                                                          : Scheduler::Admission::kInFlightOnly);
  if (plan.empty()) return false;
  counters_.schedule_seconds += seconds_since(mark);
  runner_->Execute(plan, *kv_, version, config_.check_block_versions ? &kv_->block_versions() : nullptr);
  counters_.forward_seconds += seconds_since(mark);
  counters_.forward_parts = runner_->forward_times();
  counters_.num_micro_batch_steps = runner_->micro_batch_forwards();
  const std::vector<SamplingTarget> targets = scheduler_->PrepareSampling(plan);
  const std::vector<TokenChoice> choices = runner_->Sample(targets);
  counters_.sample_seconds += seconds_since(mark);
  std::vector<SampleResult> finished = scheduler_->Commit(plan, targets, choices, version);
  WarnOfNonFiniteLogits(finished, version);
  (void)kv_->ReclaimRetired(64);
  counters_.commit_seconds += seconds_since(mark);

  ++counters_.num_steps;
  counters_.num_prefill_tokens += plan.num_prefill_tokens;
  counters_.num_generated_tokens += static_cast<int64_t>(targets.size());
  const double step_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  counters_.busy_seconds += step_seconds;
  if (plan.num_prefill_tokens == 0) {
    counters_.decode_seconds += step_seconds;
    counters_.num_decode_tokens += static_cast<int64_t>(targets.size());
  }
  Emit(std::move(finished));  // publishes the step's stats, then delivers the finished samples
  return true;
}

void Engine::PublishStats() {
  const cache::KvCacheStats kv = kv_->stats();
  counters_.num_running = scheduler_->num_running();
  counters_.num_waiting = scheduler_->num_waiting();
  counters_.num_free_blocks = kv.num_free_blocks;
  counters_.num_used_blocks = kv.num_used_blocks;
  counters_.peak_used_blocks = std::max(counters_.peak_used_blocks, kv.num_used_blocks);
  counters_.num_cached_blocks = kv.num_cached_blocks;
  counters_.num_retired_blocks = kv.num_retired_blocks;
  const int64_t admitted = kv.num_prefix_hit_tokens + kv.num_prefix_miss_tokens;
  counters_.prefix_hit_rate = admitted > 0 ? static_cast<double>(kv.num_prefix_hit_tokens) / admitted : 0.0;
  counters_.num_preemptions = scheduler_->num_preemptions();
  counters_.num_saturated_kv_values = runner_->num_saturated_kv_values();
  counters_.tokens_per_second = counters_.num_generated_tokens / std::max(1e-9, counters_.busy_seconds);
  counters_.policy_version = version_.load();
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_ = counters_;
}

void Engine::FlushNow() {
  std::vector<std::function<void(int32_t)>> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!flush_requested_) return;
    flush_requested_ = false;
    done.swap(flush_done_);
  }
  const int32_t evicted = kv_->EvictCachedBlocks(std::numeric_limits<int32_t>::max());
  while (kv_->ReclaimRetired(1 << 20) > 0) {
  }
  Logger("rollout").info("prefix cache flushed: {} blocks evicted", evicted);
  PublishStats();  // first: whoever the callbacks tell may look at the stats at once
  for (const auto& f : done) f(evicted);
}

bool Engine::SafePoint() {
  bool paused = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!update_ && update_inbox_) {
      update_ = std::move(update_inbox_);
      update_inbox_.reset();
    }
    paused = paused_;
  }
  FlushNow();
  if (!update_) return true;
  PendingUpdate& u = *update_;
  if (u.staging->pending_version() <= version_.load()) {
    // Refused before any in-flight sequence is drained, aborted, restarted or recomputed for it.
    RefuseUpdate(u, fmt::format("update to version {} refused: version {} is already in use",
                                u.staging->pending_version(), version_.load()));
    update_.reset();
    return true;
  }
  // Paused, running sequences cannot finish: a drain becomes a restart (said in the ack's counts).
  const InFlightMode mode = (u.mode == InFlightMode::kDrain && paused) ? InFlightMode::kRestart : u.mode;
  UpdateResult counts;
  switch (mode) {
    case InFlightMode::kDrain:
      if (u.num_drained < 0) u.num_drained = static_cast<int>(scheduler_->InFlight().size());  // at first sight
      if (scheduler_->HasInFlight()) return false;  // keep stepping, admit nothing new
      break;
    case InFlightMode::kAbort:
      for (Sequence* seq : scheduler_->InFlight()) {
        std::vector<SampleResult> results = scheduler_->Finish(seq, FinishReason::kAborted);
        counts.num_aborted += static_cast<int>(results.size());
        Emit(std::move(results));
      }
      break;
    case InFlightMode::kRestart:
      // A drain cut short by a pause: only the sequences that finished since it began drained
      // (nothing was admitted meanwhile, so those still in flight are among the ones counted).
      if (u.num_drained >= 0) u.num_drained -= static_cast<int>(scheduler_->InFlight().size());
      for (Sequence* seq : scheduler_->InFlight()) {
        scheduler_->Requeue(seq, Scheduler::RequeueReason::kRestart);
        ++counts.num_restarted;
      }
      break;
    case InFlightMode::kContinue:
      for (Sequence* seq : scheduler_->InFlight()) {
        scheduler_->Requeue(seq, Scheduler::RequeueReason::kRecompute);
        ++counts.num_recomputed;
      }
      break;
  }
  counts.num_drained = std::max(0, u.num_drained);
  ApplyUpdate(u, counts);
  update_.reset();
  return true;
}

void Engine::RefuseUpdate(PendingUpdate& u, std::string error) {
  UpdateResult ack;
  ack.mode = u.mode;
  ack.wait_ms = std::chrono::duration<double, std::milli>(Clock::now() - u.submitted).count();
  ack.version = version_.load();
  ack.error = std::move(error);
  u.staging->Abort();
  {
    std::lock_guard<std::mutex> lock(mu_);
    update_pending_ = false;
  }
  Logger("rollout").warn("weight update refused: {}", ack.error);
  if (u.on_done) CallBack("weight update", u.on_done, std::move(ack));
}

void Engine::ApplyUpdate(PendingUpdate& u, UpdateResult ack) {
  const auto t0 = Clock::now();
  ack.mode = u.mode;
  ack.wait_ms = std::chrono::duration<double, std::milli>(t0 - u.submitted).count();
  const PolicyVersion new_version = u.staging->pending_version();  // > version_: SafePoint checked
  // One critical section on the engine thread: weights, version and prefix cache move together.
  runner_->ApplyWeights(u.staging->verified(), u.staging->transaction_id());
  {
    // A bound staging staged into the spares, which the swap just made the model's weights: it
    // stages the next update into the new spares (the old weights' memory).
    std::lock_guard<std::mutex> lock(staging_mu_);
    spare_buffers_ = runner_->StagingBuffers();
    if (bound_staging_.lock().get() == u.staging) u.staging->UseValueBuffers(spare_buffers_);
  }
  // Stored only now, once the new weights are in: other threads read version_ (health replies,
  // min_policy_version checks) and must never see the new version beside the old weights
  // (helper-78's mutation m07b, storing it first, is invisible to the engine thread itself).
  version_.store(new_version);
  kv_->Invalidate(new_version);
  ack.weights_checksum = runner_->WeightsChecksum();
  ack.version = new_version;
  ack.ok = true;
  u.staging->Finish();
  ack.stall_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    update_pending_ = false;
  }
  PublishStats();
  Logger("rollout").info(
      "weight update applied: version {} ({}; drained {}, aborted {}, restarted {}, recomputed {}; waited {:.1f} ms, "
      "stall {:.2f} ms{}, checksum {:016x})",
      ack.version, InFlightModeName(ack.mode), ack.num_drained, ack.num_aborted, ack.num_restarted,
      ack.num_recomputed, ack.wait_ms, ack.stall_ms,
      runner_->last_apply_prepacked() ? fmt::format(", packed while staging in {:.1f} ms", runner_->last_prepack_ms())
                                      : std::string(", repacked here"),
      ack.weights_checksum);
  if (u.on_done) CallBack("weight update", u.on_done, std::move(ack));
}

std::shared_ptr<policy::WeightUpdateStaging> Engine::MakeStaging() {
  auto staging = std::make_shared<policy::WeightUpdateStaging>(param_specs_);
  staging->set_model_rope_layout(model_config_.rope_layout);
  std::lock_guard<std::mutex> lock(staging_mu_);
  if (bound_staging_.expired()) {  // no other staging writes into the spares
    staging->UseValueBuffers(spare_buffers_);
    staging->SetObserver(runner_->staging_observer());  // packs GEMM weights as they are staged
    bound_staging_ = staging;
  }
  // Applying in place is the memory-lean mode: no staged copy of the weights between updates.
  if (!config_.swap_weight_buffers) staging->set_keep_buffers(false);
  return staging;
}

SubmitStatus Engine::SubmitUpdate(policy::WeightUpdateStaging* staging, InFlightMode mode,
                                  std::function<void(UpdateResult)> on_done) {
  if (staging == nullptr || staging->state() != policy::WeightUpdateStaging::State::kVerified) {
    return {SubmitStatus::Code::kInvalid, "weight update is not verified (commit staging first)"};
  }
  // A NaN or infinite weight would turn every logit into NaN: refuse it here, on the caller's
  // thread (outside the engine's stall), naming the tensor and the element. The staging found
  // them while the bytes arrived, so this reads no weights.
  if (const policy::UpdateStatus finite = policy::CheckWeightsFinite(staging->verified()); !finite.ok()) {
    return {SubmitStatus::Code::kInvalid,
            fmt::format("weight update to version {}: {}", staging->pending_version(), finite.error())};
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && threaded_) return {SubmitStatus::Code::kStopped, "engine is stopping"};
    if (update_pending_) return {SubmitStatus::Code::kOverloaded, "another weight update is pending"};
    update_pending_ = true;
    update_inbox_ = PendingUpdate{staging, mode, std::move(on_done), Clock::now(), -1};
  }
  cv_.notify_all();
  return {};
}

UpdateResult Engine::UpdateWeights(const policy::WeightMap& weights, PolicyVersion version, InFlightMode mode,
                                   bool partial, std::optional<policy::RopeLayout> rope_layout) {
  // Counted while it runs, so that a Generate stepping on another caller's thread does not take
  // the idle engine for one that will never reach its min_policy_version (see Generate).
  struct InProgress {
    Engine& engine;
    explicit InProgress(Engine& e) : engine(e) { engine.sync_updates_in_progress_.fetch_add(1); }
    ~InProgress() {
      engine.sync_updates_in_progress_.fetch_sub(1);
      engine.cv_.notify_all();
    }
  } in_progress(*this);
  std::lock_guard<std::mutex> one_at_a_time(sync_update_mu_);
  if (!sync_staging_) sync_staging_ = MakeStaging();
  policy::WeightUpdateStaging& staging = *sync_staging_;
  auto refuse = [&](const std::string& error) {
    staging.Abort();
    UpdateResult r;
    r.error = error;
    r.version = version_.load();
    r.mode = mode;
    return r;
  };
  policy::UpdateManifest manifest;
  manifest.version = version;
  manifest.partial = partial;
  manifest.rope_layout = rope_layout;
  for (const auto& [name, tensor] : weights) {
    const size_t bytes = tensor.data.size() * sizeof(float);
    manifest.tensors.push_back(
        {name, policy::DType::kF32, tensor.shape, bytes, policy::TensorChecksum(tensor.data.data(), bytes)});
  }
  policy::UpdateStatus st = staging.Begin(manifest, version_.load());
  if (!st.ok()) return refuse(st.error());
  for (const auto& [name, tensor] : weights) {
    st = staging.Write(name, 0, tensor.data.data(), tensor.data.size() * sizeof(float));
    if (!st.ok()) return refuse(st.error());
  }
  st = staging.Verify();
  if (!st.ok()) return refuse(st.error());

  // Shared with the acknowledgement callback: if a step on this thread throws, the update is
  // still acknowledged later (by another caller's step, or Stop), into this state, not this frame.
  struct Ack {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<UpdateResult> result;
  };
  auto ack = std::make_shared<Ack>();
  SubmitStatus submitted = SubmitUpdate(&staging, mode, [ack](UpdateResult r) {
    std::lock_guard<std::mutex> lock(ack->mu);
    ack->result = std::move(r);
    ack->cv.notify_all();
  });
  if (!submitted.ok()) return refuse(submitted.error);
  // Without the engine thread, run steps here until the update is acknowledged (another caller's
  // steps may apply it too); once the thread runs (Start, even meanwhile), wait for it.
  while (true) {
    {
      std::lock_guard<std::mutex> lock(ack->mu);
      if (ack->result.has_value()) break;
    }
    if (!StepOnCaller([](const std::exception&) {}).has_value()) {
      std::unique_lock<std::mutex> lock(ack->mu);
      ack->cv.wait(lock, [&] { return ack->result.has_value(); });
      break;
    }
  }
  return *ack->result;
}

void Engine::Pause() {
  std::lock_guard<std::mutex> lock(mu_);
  paused_ = true;
}

void Engine::Resume() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
  }
  cv_.notify_all();
}

void Engine::FlushCache(std::function<void(int32_t num_evicted)> done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    flush_requested_ = true;
    if (done) flush_done_.push_back(std::move(done));
  }
  cv_.notify_all();
}

void Engine::Loop() {
  auto& log = Logger("rollout");
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) break;
    }
    bool progressed = false;
    try {
      progressed = StepOwned();
    } catch (const std::exception& e) {
      // No exception leaves the engine thread: fail every live request with the reason.
      log.error("engine step failed: {}", e.what());
      std::vector<std::string> ids;
      for (const auto& [id, state] : live_) ids.push_back(id);
      for (const std::string& id : ids) {
        std::vector<SampleResult> results = scheduler_->AbortRequest(id, FinishReason::kError);
        for (SampleResult& r : results) r.error = fmt::format("engine step failed: {}", e.what());
        Emit(std::move(results));
      }
    }
    if (!progressed) {
      PublishStats();  // aborts, admissions and updates change counts without a step
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(20), [this] {
        return stop_ || !inbox_.empty() || !abort_inbox_.empty() || update_inbox_.has_value() || flush_requested_;
      });
    }
  }
  FlushNow();  // one asked for as the engine stopped: done and acknowledged all the same
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s = snapshot_;
  s.paused = paused_;
  return s;
}

bool Engine::paused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return paused_;
}

std::vector<SampleResult> Engine::Generate(const std::vector<Request>& requests) {
  // Shared with the callbacks: a request still running when this call throws (a later request
  // refused, or an idle engine) delivers its results into this state, not into a dead frame.
  struct Collected {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<SampleResult> results;
  };
  auto collected = std::make_shared<Collected>();
  size_t expected = 0;
  for (const Request& r : requests) expected += static_cast<size_t>(std::max(r.n, 0));
  std::vector<std::string> submitted;
  auto received = [&] {
    std::lock_guard<std::mutex> lock(collected->mu);
    return collected->results.size();
  };
  // On failure, the requests already submitted are aborted (nobody will read their samples).
  auto fail = [&](const auto& error) {
    for (const std::string& id : submitted) Abort(id);
    {
      std::lock_guard<std::mutex> own(caller_mu_);
      if (!Threaded()) DrainInbox();  // the aborts take effect before this call returns
    }
    throw error;
  };
  for (const Request& r : requests) {
    SubmitStatus s = Submit(r, [collected](SampleResult result) {
      std::lock_guard<std::mutex> lock(collected->mu);
      collected->results.push_back(std::move(result));
      collected->cv.notify_all();
    });
    if (!s.ok()) fail(std::invalid_argument(fmt::format("request '{}' refused: {}", r.request_id, s.error)));
    submitted.push_back(r.request_id);
  }
  // Without the engine thread, run steps here until every sample of the call is in (another
  // caller's steps may deliver some); once the thread runs (Start, even meanwhile), wait for it.
  while (received() < expected) {
    const std::optional<bool> stepped = StepOnCaller([&](const std::exception& e) {
      // As the engine thread's loop does: the call's requests end, not left running for nobody.
      for (const std::string& id : submitted) {
        std::vector<SampleResult> results = scheduler_->AbortRequest(id, FinishReason::kError);
        for (SampleResult& r : results) r.error = fmt::format("engine step failed: {}", e.what());
        Emit(std::move(results));
      }
    });
    if (!stepped.has_value()) {
      std::unique_lock<std::mutex> lock(collected->mu);
      collected->cv.wait(lock, [&] { return collected->results.size() >= expected; });
      break;
    }
    const size_t got = received();
    if (!*stepped && got < expected && sync_updates_in_progress_.load() > 0) {
      // Idle now, but an UpdateWeights on another thread is staging a version these requests
      // may wait for: wait for it to be submitted (or to end) rather than fail.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(20),
                   [this] { return update_inbox_.has_value() || sync_updates_in_progress_.load() == 0; });
      continue;
    }
    if (!*stepped && got < expected) {
      fail(std::runtime_error(fmt::format("engine went idle with {} of {} samples unfinished ({})", expected - got,
                                          expected,
                                          paused() ? "the engine is paused: Resume() it (with the engine thread "
                                                     "running, Generate waits for a Resume)"
                                                   : "min_policy_version not reached?")));
    }
  }
  std::vector<SampleResult> results = std::move(collected->results);
  std::sort(results.begin(), results.end(), [](const SampleResult& a, const SampleResult& b) {
    return std::tie(a.request_id, a.sample_index) < std::tie(b.request_id, b.sample_index);
  });
  return results;
}

}  // namespace vroll::rollout
