#pragma once
// The rollout engine: one thread owns the scheduler, the KV cache and the model, and runs
//   safe point (weight updates) -> schedule -> run model -> sample -> finish/free/emit
// in a loop. Other threads submit requests and receive each sample's result as it finishes.
// Torch-free header: the transport layer includes it.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/kv_cache_manager.h"
#include "policy/forward_times.h"
#include "policy/weight_update.h"
#include "policy/weights.h"
#include "rollout/request.h"
#include "rollout/scheduler.h"

namespace vroll::rollout {

class ModelRunner;

struct EngineConfig {
  int64_t kv_cache_bytes = int64_t{256} << 20;  ///< KV memory budget (all layers, K and V), bytes
  int block_size = 16;                          ///< tokens per KV block
  /// Element type of the KV cache (cache::KvCacheDtype): float16 or bfloat16 hold twice the
  /// tokens in kv_cache_bytes (attention faster on AVX-512F CPUs for head sizes 16, 32, 48, 64, 80,
  /// 96 and 128, else up to ~10% slower: docs/KV_CACHE.md); the logprobs reported are
  /// still exactly those of the model that sampled (the behavior policy), whose keys and values
  /// are rounded to 16 bits, so they differ from an fp32 recompute by that rounding.
  cache::KvCacheDtype kv_cache_dtype = cache::KvCacheDtype::kFloat32;
  bool enable_prefix_caching = true;
  /// Blocks kept free at admission for running sequences to grow into; -1: 1% of the blocks.
  int watermark_blocks = -1;
  int max_num_seqs = 256;             ///< running sequences at once
  int max_num_batched_tokens = 2048;  ///< tokens computed per step (decodes + prefill chunks)
  /// Requests accepted but not finished, at most; beyond it Submit answers "overloaded".
  int max_pending_requests = 4096;
  uint64_t seed = 0;  ///< draws the seeds of requests that carry none
  bool check_block_versions = false;  ///< see ModelRunnerConfig; on in tests and in vroll-worker
  /// Bitwise batch-invariant outputs (policy::ModelOptions::batch_invariant): every GEMM runs on
  /// at least 32 rows. Off, single-sequence steps of large-vocabulary models are faster, and a
  /// sample's logits may differ in the last bits depending on what else is in the step.
  bool batch_invariant = true;
  /// Weight updates staged by the engine's bound staging (MakeStaging) are swapped into the
  /// model instead of copied, their GEMM weights packed on the staging's thread as they arrive
  /// rather than repacked at the safe point (ModelRunnerConfig::swap_weight_buffers): the stall
  /// drops to microseconds, for one spare copy of the weights and one of the packed GEMM
  /// weights, allocated at construction. Off (vroll-worker --no-spare-weights): updates are
  /// copied into the model and its GEMM weights repacked at the safe point (a stall of about one
  /// pass over the weights), the engine's stagings release their buffers after each update, and
  /// the weights take ~2x their fp32 size between updates (fp32 + packed), ~3x during one, instead
  /// of 4x.
  bool swap_weight_buffers = true;
  /// See ModelRunnerConfig::prepack_weights (off: the safe point repacks every update).
  bool prepack_weights = true;
  /// CPU forward pass as micro-batches where a step fits (policy::ModelOptions::micro_batches);
  /// off (vroll-worker --no-micro-batches): every step as one batch. Same outputs bit for bit.
  bool micro_batches = true;

  /// Throws policy::ConfigError naming the field.
  void Validate() const;
};

/// Outcome of Submit: ok, or why the request was refused (nothing was queued).
struct [[nodiscard]] SubmitStatus {
  enum class Code { kOk, kInvalid, kOverloaded, kStopped };
  Code code = Code::kOk;
  std::string error;  ///< names the bad field, e.g. "prompt[3] = 600 outside the vocabulary [0, 512)"
  bool ok() const { return code == Code::kOk; }
};

/// What happens to sequences in flight when a weight update commits (chosen per update).
enum class InFlightMode {
  kDrain,     ///< stop admitting, finish running sequences under the old weights, then apply
  kAbort,     ///< running sequences end "aborted"; their partial tokens keep the old version
  kRestart,   ///< running sequences drop their tokens and start again under the new version
  kContinue,  ///< running sequences recompute their KV under the new weights and go on; their
              ///< tokens carry version spans
};

/// "drain", "abort", "restart", "continue".
const char* InFlightModeName(InFlightMode mode);
/// Parses InFlightModeName's names; nullopt for anything else.
std::optional<InFlightMode> ParseInFlightMode(const std::string& name);

/// The acknowledgement of a weight update.
struct UpdateResult {
  bool ok = false;
  std::string error;            ///< names the tensor / field when !ok; nothing was changed then
  PolicyVersion version = 0;    ///< the version now in use (the new one when ok)
  uint64_t weights_checksum = 0;  ///< policy::WeightsChecksum of every parameter now in use
  InFlightMode mode = InFlightMode::kDrain;
  int num_drained = 0;     ///< sequences that finished under the old weights before the swap
  int num_aborted = 0;     ///< samples ended "aborted"
  int num_restarted = 0;   ///< sequences restarted from their prompt
  int num_recomputed = 0;  ///< sequences whose KV is recomputed under the new weights
  double wait_ms = 0;      ///< submit -> swap (draining time)
  double stall_ms = 0;     ///< engine time inside the swap: copy, version bump, cache invalidation
};

/// A snapshot; counters are cumulative since construction.
struct EngineStats {
  int num_running = 0;
  int num_waiting = 0;
  int num_blocks = 0;
  int num_free_blocks = 0;     ///< KV blocks on the free list
  /// KV blocks held (reference count >= 1): by running sequences' block tables, by the prefix
  /// cache of the current policy version, or retired: indexed by an older version's prefix cache
  /// after a weight update, never reused for lookups, reclaimed lazily (when blocks are needed,
  /// and a bounded number per step) or at once by FlushCache. So after an update an idle engine
  /// can show used blocks with nothing running and nothing cached.
  int num_used_blocks = 0;
  int num_cached_blocks = 0;   ///< KV blocks indexed by the current version's prefix cache
  /// Of num_used_blocks: KV blocks indexed by an older version's prefix cache (retired by a
  /// weight update, awaiting reclaim; a sequence admitted before the update may still hold
  /// some). An idle engine after an update: used = retired, until steps or FlushCache reclaim them.
  int num_retired_blocks = 0;
  int peak_used_blocks = 0;    ///< most blocks in use after any step
  double prefix_hit_rate = 0;  ///< prompt tokens served from the prefix cache / prompt tokens admitted
  int64_t num_steps = 0;
  /// Steps whose CPU forward pass ran as micro-batches (policy::LlamaModel::micro_batch_forwards;
  /// none with EngineConfig::micro_batches off).
  int64_t num_micro_batch_steps = 0;
  int64_t num_prefill_tokens = 0;   ///< prompt (and recompute) tokens computed
  int64_t num_generated_tokens = 0;
  int64_t num_preemptions = 0;
  int64_t num_finished_samples = 0;
  /// float16 KV cache: finite keys/values that lay beyond +-65504 and were stored as +-65504
  /// (the logprobs are then not the fp32 model's beyond rounding; docs/KV_CACHE.md). 0 otherwise.
  int64_t num_saturated_kv_values = 0;
  double busy_seconds = 0;          ///< time spent in steps, of which:
  double schedule_seconds = 0;      ///<   scheduling (block tables, preemption, admission)
  double forward_seconds = 0;       ///<   the model's forward pass (incl. copy-on-write copies),
  policy::ForwardTimes forward_parts;  ///<     of which these parts (CPU; zero on other devices)
  double sample_seconds = 0;        ///<   sampling (softmax, logprobs, draws)
  double commit_seconds = 0;        ///<   appending tokens, prefix-cache inserts, finishing (not delivering results)
  double tokens_per_second = 0;     ///< generated tokens / busy seconds
  /// Decode-only steps (no prompt or recompute token computed): their time, included in
  /// busy_seconds, and the tokens they generated (one per running sequence each).
  double decode_seconds = 0;
  int64_t num_decode_tokens = 0;
  PolicyVersion policy_version = 0;
  bool paused = false;  ///< Pause() in effect: no step runs until Resume() (read when stats() is called)
};

/// Thread safety: Submit, Abort, stats and policy_version may be called from any thread.
/// Start/Stop from one controlling thread. Without Start, Step, Generate and UpdateWeights run
/// the engine's steps on the calling thread; calls from several threads at once are serialized
/// one step at a time (each step serves every request, whoever submitted it), and Start waits
/// for such a step to end, after which those calls wait for the engine thread instead.
class Engine {
 public:
  using ResultCallback = std::function<void(SampleResult)>;

  /// Builds the model and the KV cache (num_blocks = kv_cache_bytes / bytes per block; logged).
  /// Throws policy::LoadError / ConfigError.
  Engine(const policy::Checkpoint& checkpoint, const EngineConfig& config);
  ~Engine();  ///< stops the thread; unfinished samples end with finish reason "aborted"

  /// Starts the engine thread. Start and Stop are called from one controlling thread (Submit,
  /// Abort, Generate, SubmitUpdate and UpdateWeights may run on others meanwhile).
  void Start();
  /// Stops the engine thread after the current step; unfinished samples get "aborted" results,
  /// and a submitted weight update not yet applied is acknowledged as refused (its staging
  /// aborted), so every on_done is called.
  void Stop();

  /// Validates and queues `request`; `on_result` is called once per sample, on the engine thread
  /// (without Start: on the caller's thread running that step), as each finishes. It must be
  /// quick (enqueue and return) and must not call Step, Generate, UpdateWeights, Start or Stop
  /// (it runs inside a step: that would deadlock); an exception it throws is logged and ignored.
  /// Refusals are returned, not thrown.
  SubmitStatus Submit(Request request, ResultCallback on_result);
  /// The checks Submit makes of the request itself (ids, prompt, n, sampling params), without
  /// queuing it: kInvalid with the message Submit would give, else ok. Thread-safe (reads only
  /// immutable state). For a front end that refuses for reasons of its own (e.g. a per-client
  /// limit) but should name a bad field first.
  SubmitStatus Validate(const Request& request) const;
  /// Whether a request with this id is accepted and unfinished (Submit would refuse another as
  /// "already in flight"). Thread-safe.
  bool InFlight(const std::string& request_id) const;
  /// Ends the request's unfinished samples with finish reason "aborted". Unknown or finished ids:
  /// no-op (an abort of a finished request does not end a later one that reuses its id).
  void Abort(const std::string& request_id);

  /// Submits all and waits for every sample's result; returns them ordered by (request, sample).
  /// With the thread stopped, runs steps on the calling thread. Throws std::invalid_argument
  /// naming the request when one is refused, or (thread stopped) std::runtime_error when the
  /// engine goes idle first (e.g. min_policy_version not reached); the call's requests already
  /// submitted are then aborted.
  std::vector<SampleResult> Generate(const std::vector<Request>& requests);

  /// Runs one step on the calling thread (engine not started). Returns false when idle.
  /// Throws std::logic_error while the engine thread runs (between Start and the end of Stop).
  bool Step();

  // ---- Weight updates ---------------------------------------------------------------------------

  /// The model's parameters (canonical names, shapes), for a WeightUpdateStaging. Immutable.
  const std::vector<policy::ParamSpec>& param_specs() const { return param_specs_; }

  /// A staging for this engine's parameters. The first one made (again once it is destroyed) is
  /// bound to the model's spare buffers (ModelRunner::StagingBuffers): it stages fp32 values in
  /// place and its updates are swapped into the model rather than copied; the engine re-points
  /// it to the new spares as it applies (while the staging is handed over). It is also observed
  /// by ModelRunner::staging_observer(): its Write/Verify calls pack each GEMM weight into a
  /// spare packed buffer once the update's tensors in it are staged (serially, on the caller's
  /// thread; a partly named fused weight is completed with the model's current values), so the
  /// safe point swaps packed buffers too and repacks nothing. Others stage into their own
  /// buffers and are applied by copy and a repack on the engine thread. Any thread.
  /// A staging may outlive its engine: the engine's destructor aborts the bound staging's open
  /// transaction and detaches it from the model's buffers (it then stages into its own, and no
  /// engine applies it). No thread may use the bound staging while the engine is being destroyed.
  std::shared_ptr<policy::WeightUpdateStaging> MakeStaging();

  /// Hands a verified transaction to the engine thread, which at its next safe point (after
  /// dealing with in-flight sequences per `mode`) installs the weights (ModelRunner::ApplyWeights:
  /// a swap of prepared buffers for the bound staging, else copy and repack), bumps the
  /// version and invalidates the prefix cache in one critical section, then calls `on_done` (on
  /// the thread running that step, with Submit's rules for on_result) with the acknowledgement. `staging` must be verified and left untouched
  /// until `on_done` runs; the engine calls staging->Finish() before it. An update whose version
  /// is not above the version in use by then is refused in its acknowledgement (staging aborted)
  /// before any in-flight sequence is touched; so is one still pending at Stop(), on the
  /// stopping thread. Refused (returned, and
  /// `on_done` not called): kInvalid when the staging is not verified or holds a NaN/infinite
  /// weight (the error names the tensor and element; VerifiedTensor::first_nonfinite, so this
  /// reads no weights), kOverloaded when another update is pending.
  /// Queued requests holding no KV never delay an update. While paused, a drain update restarts
  /// the running sequences (they cannot finish without running).
  SubmitStatus SubmitUpdate(policy::WeightUpdateStaging* staging, InFlightMode mode,
                            std::function<void(UpdateResult)> on_done);

  /// Convenience for in-process trainers and tests: stages `weights` (fp32, canonical names;
  /// all parameters unless `partial`) as version `version`, verifies, submits and waits for the
  /// acknowledgement (running steps on this thread when the engine thread is not started).
  /// `rope_layout`: the RoPE layout of the q_proj/k_proj rows in `weights` when the caller knows
  /// it (policy::UpdateManifest::rope_layout): another layout than the model's is refused
  /// (UpdateResult::error names it); nullopt: not checked.
  UpdateResult UpdateWeights(const policy::WeightMap& weights, PolicyVersion version,
                             InFlightMode mode = InFlightMode::kDrain, bool partial = false,
                             std::optional<policy::RopeLayout> rope_layout = std::nullopt);

  /// Pause: no steps run (pending updates still apply at the safe point). Resume: steps again.
  void Pause();
  void Resume();
  /// Drops every unreferenced block of the prefix cache (and frees the retired ones) at the next
  /// safe point, then calls `done`, if given, with the number of blocks evicted: on the thread
  /// that runs the step (the engine thread once Start()ed), after stats() shows the flush, and
  /// before the step's forward pass. Safe points run while paused too. A flush still pending
  /// when the engine thread stops is done then. Thread-safe; `done` must not call back into the
  /// engine's blocking calls.
  void FlushCache(std::function<void(int32_t num_evicted)> done = {});

  EngineStats stats() const;
  PolicyVersion policy_version() const { return version_.load(); }
  /// Whether Pause() is in effect (no step runs until Resume()).
  bool paused() const;
  const policy::ModelConfig& model_config() const { return model_config_; }
  /// The longest sequence (prompt + output, tokens) the engine runs: the model's context
  /// (max_seq_len), or less when the KV cache cannot hold that many tokens of one sequence beyond
  /// the watermark (then the constructor logs a warning naming the cache size needed). Prompts
  /// must be shorter; generation ends with FinishReason::kLength when a sequence reaches it.
  int max_model_len() const { return max_model_len_; }
  /// EngineConfig::max_num_seqs: the most samples one request may ask for (n), and the most
  /// sequences a step runs.
  int max_num_seqs() const { return config_.max_num_seqs; }
  /// EngineConfig::kv_cache_dtype: the KV cache's element type (16 bits: the behavior policy's
  /// keys and values are rounded, so its logprobs differ from an fp32 recompute).
  cache::KvCacheDtype kv_cache_dtype() const { return config_.kv_cache_dtype; }
  /// The error for a prompt of `num_prompt_tokens` >= max_model_len() (names the cap's cause).
  std::string ContextMessage(size_t num_prompt_tokens) const;

 private:
  struct PendingUpdate {
    policy::WeightUpdateStaging* staging = nullptr;
    InFlightMode mode = InFlightMode::kDrain;
    std::function<void(UpdateResult)> on_done;
    Clock::time_point submitted;
    int num_drained = -1;  // in-flight sequences when a drain started; -1 before
  };

  void Loop();
  void DrainInbox();
  /// The flush FlushCache asked for, if one is pending: evicts, publishes stats, then calls
  /// its callbacks. Engine thread (or the caller's, when steps run on it).
  void FlushNow();
  /// The safe point: does a pending flush, and applies a pending update when its mode allows.
  /// Returns whether admissions may go on this step (false while draining).
  bool SafePoint();
  /// Swaps the weights, bumps the version and invalidates the prefix cache; acknowledges.
  void ApplyUpdate(PendingUpdate& update, UpdateResult ack);
  /// Aborts the update's staging and acknowledges it as refused with `error`; nothing changes.
  void RefuseUpdate(PendingUpdate& update, std::string error);
  void PublishStats();
  void Emit(std::vector<SampleResult> results);
  void AbortAll();
  /// Logs (once per policy version) that samples ended on NaN/inf logits.
  void WarnOfNonFiniteLogits(const std::vector<SampleResult>& finished, PolicyVersion version);
  PolicyVersion nonfinite_warned_version_ = 0;  // version + 1 last warned of (engine thread)
  bool Threaded() const;  // threaded_, read under mu_ (thread_ itself is Start/Stop's only)
  /// One step's body: on the engine thread, or on a caller's holding caller_mu_ (not threaded).
  bool StepOwned();
  /// A step on the calling thread (caller_mu_ held for it): nullopt when the engine thread runs,
  /// else StepOwned's result. When the step throws a std::exception, `on_error(e)` runs first,
  /// still owning the engine (e.g. to fail the caller's requests), then it propagates.
  template <class OnError>
  std::optional<bool> StepOnCaller(OnError&& on_error);

  // Immutable after construction.
  const EngineConfig config_;
  policy::ModelConfig model_config_;
  int max_model_len_ = 0;  // see max_model_len()
  int num_kv_blocks_ = 0;
  std::vector<policy::ParamSpec> param_specs_;

  // Held by a caller's thread for each step it runs without the engine thread (and by Start,
  // and Stop's final aborts), so that one thread at a time owns what follows.
  std::mutex caller_mu_;

  // The engine thread's, or (not started) the thread holding caller_mu_.
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<cache::KvCacheManager> kv_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unordered_map<std::string, std::shared_ptr<RequestState>> live_;  // by request id
  std::unordered_map<std::string, ResultCallback> callbacks_;
  uint64_t seed_state_;
  EngineStats counters_;
  std::optional<PendingUpdate> update_;          // taken from update_inbox_ at a safe point
  std::mutex sync_update_mu_;  // one UpdateWeights at a time; guards sync_staging_
  std::atomic<int> sync_updates_in_progress_{0};  // UpdateWeights calls running (any thread)
  std::shared_ptr<policy::WeightUpdateStaging> sync_staging_;  // UpdateWeights' buffers, reused
  std::mutex staging_mu_;  // guards bound_staging_ and spare_buffers_
  std::weak_ptr<policy::WeightUpdateStaging> bound_staging_;  // MakeStaging's bound one
  std::vector<float*> spare_buffers_;  // runner_->StagingBuffers(), refreshed after each apply

  std::atomic<PolicyVersion> version_{0};

  // Inbox: guarded by mu_.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Submitted {
    Request request;
    ResultCallback on_result;
    uint64_t submission;  // Submit's count: which use of a request id this is
  };
  std::vector<Submitted> inbox_;
  // Aborts of live requests: the id and the submission it ends, so that an abort still queued
  // when its request finishes cannot end a later request that reuses the id.
  std::vector<std::pair<std::string, uint64_t>> abort_inbox_;
  int num_pending_ = 0;   // accepted and not finished (bounded by max_pending_requests)
  std::unordered_map<std::string, uint64_t> pending_ids_;  // live request id -> its submission
  uint64_t num_submissions_ = 0;
  bool stop_ = false;
  bool threaded_ = false;  // between Start() and the end of Stop(): the engine thread owns the engine
  bool paused_ = false;
  bool flush_requested_ = false;
  std::vector<std::function<void(int32_t)>> flush_done_;  // FlushCache callbacks of the pending flush
  std::optional<PendingUpdate> update_inbox_;
  bool update_pending_ = false;  // submitted and not yet acknowledged
  EngineStats snapshot_;  // published after each step

  std::thread thread_;
};

}  // namespace vroll::rollout
