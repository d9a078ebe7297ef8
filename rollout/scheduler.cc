#include "rollout/scheduler.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "policy/check.h"
#include "policy/errors.h"

namespace vroll::rollout {

void SchedulerConfig::Validate() const {
  auto fail = [](const std::string& msg) { throw policy::ConfigError("scheduler config: " + msg); };
  if (max_num_seqs < 1) fail(fmt::format("max_num_seqs = {} must be >= 1", max_num_seqs));
  if (max_num_batched_tokens < 1) fail(fmt::format("max_num_batched_tokens = {} must be >= 1", max_num_batched_tokens));
  if (max_model_len < 2) fail(fmt::format("max_model_len = {} must be >= 2", max_model_len));
}

Scheduler::Scheduler(const SchedulerConfig& config, cache::KvCacheManager* kv) : config_(config), kv_(kv) {
  config_.Validate();
}

void Scheduler::AddRequest(std::shared_ptr<RequestState> request) {
  auto seq = std::make_unique<Sequence>(next_seq_id_++, request, 0, next_arrival_++);
  seq->tokens = request->request.prompt;
  seq->num_prompt_tokens = static_cast<int32_t>(seq->tokens.size());
  seq->num_forks_pending = request->request.n - 1;
  waiting_.push_back(std::move(seq));
}

bool Scheduler::PreemptNewest(const Sequence* keep) {
  // Newest = latest arrival (ties: highest sequence id), among sequences not yet in this plan
  // and `keep` itself: when `keep` is the newest, nothing else is preempted for it.
  Sequence* victim = nullptr;
  for (const auto& s : running_) {
    if (s.get() != keep && s->planned) continue;
    if (victim == nullptr || std::tie(s->arrival, s->id) > std::tie(victim->arrival, victim->id)) victim = s.get();
  }
  if (victim == nullptr || victim == keep) return false;
  Requeue(victim, RequeueReason::kPreempted);
  return true;
}

StepPlan Scheduler::Schedule(PolicyVersion current_version, Admission admission) {
  StepPlan plan;
  int32_t budget = config_.max_num_batched_tokens;
  // Sequences already in this plan are marked `planned`, so that preemption never takes them.
  auto add = [&](Sequence* seq, int32_t n) {
    const bool samples = n == seq->num_uncomputed_tokens();
    plan.seqs.push_back({seq, n, samples});
    if (samples) seq->in_prefill = false;  // from the next step on it decodes
    budget -= n;
    seq->planned = true;
    if (!seq->has_first_schedule) {
      seq->has_first_schedule = true;
      seq->first_scheduled = Clock::now();
    }
  };

  // 1. Decodes: one token whose KV is missing, the last one sampled; its slot may have to be
  // appended first. (A prefill whose last chunk is one token is step 2's.)
  for (Sequence* seq : running()) {
    if (budget <= 0) break;
    if (seq->status != SequenceStatus::kRunning || seq->in_prefill || seq->num_uncomputed_tokens() != 1) {
      continue;  // preempted / prefill
    }
    const int32_t need = static_cast<int32_t>(seq->tokens.size()) - kv_->num_tokens(seq->id);
    bool fits = need <= 0;
    while (!fits) {
      cache::AppendResult r = kv_->AppendSlots(seq->id, need);
      if (r.ok()) {
        plan.copies.insert(plan.copies.end(), r.copies.begin(), r.copies.end());
        fits = true;
      } else if (PreemptNewest(seq)) {
        ++plan.num_preempted;
      } else {
        break;
      }
    }
    if (!fits) {  // it was the newest itself
      Requeue(seq, RequeueReason::kPreempted);
      ++plan.num_preempted;
      continue;
    }
    add(seq, 1);
    ++plan.num_decode_tokens;
  }

  // 2. Prefill chunks of admitted sequences (slots reserved at admission).
  for (const auto& s : running_) {
    if (budget <= 0) break;
    Sequence* seq = s.get();
    if (seq->planned) continue;
    VROLL_CHECK(kv_->num_tokens(seq->id) >= static_cast<int32_t>(seq->tokens.size()),
                "sequence {} in prefill lacks slots", seq->id);
    const int32_t n = std::min(seq->num_uncomputed_tokens(), budget);
    plan.num_prefill_tokens += n;
    add(seq, n);
  }

  // 3. Admissions (FIFO; requests waiting for a newer policy version are passed over).
  if (plan.num_preempted == 0) {
    // Running sequences, counting the samples that groups still in prefill will fork.
    int num_seqs = 0;
    for (const auto& s : running_) num_seqs += 1 + s->num_forks_pending;
    for (auto it = waiting_.begin(); it != waiting_.end() && budget > 0;) {
      Sequence* seq = it->get();
      if (admission == Admission::kInFlightOnly && !seq->was_admitted) {
        ++it;
        continue;
      }
      // A request waiting for a newer policy version is passed over before anything else is
      // asked of it: its group size must not stop the requests behind it.
      if (seq->request->request.min_policy_version > current_version) {
        ++it;
        continue;
      }
      const int group = 1 + seq->num_forks_pending;
      if (num_seqs + group > config_.max_num_seqs) break;
      cache::AllocateResult r = kv_->Allocate(seq->id, seq->tokens);
      if (!r.ok()) break;
      seq->num_computed_tokens = r.num_cached_tokens;
      if (seq->num_preemptions == 0 && seq->num_output_tokens() == 0) {
        seq->num_cached_prompt_tokens = r.num_cached_tokens;
      }
      seq->status = SequenceStatus::kRunning;
      seq->was_admitted = true;
      seq->in_prefill = true;
      num_seqs += group;
      running_.push_back(std::move(*it));
      it = waiting_.erase(it);
      const int32_t n = std::min(seq->num_uncomputed_tokens(), budget);
      plan.num_prefill_tokens += n;
      add(seq, n);
    }
  }
  for (const ScheduledSequence& s : plan.seqs) s.seq->planned = false;
  return plan;
}

std::vector<SamplingTarget> Scheduler::PrepareSampling(const StepPlan& plan) {
  std::vector<SamplingTarget> targets;
  int32_t row = 0;
  for (const ScheduledSequence& s : plan.seqs) {
    if (!s.samples) continue;
    Sequence* seq = s.seq;
    targets.push_back({row, seq});
    if (seq->num_forks_pending > 0) {
      // The prompt is complete: fork the group's other samples off it, sharing every block. They
      // join the running list right after it (same arrival: the list stays in arrival order), so
      // a group's rows stay together in later steps' batches: the forward pass's micro-batches
      // (runs of whole sequences, one per thread) then hold whole groups and read each prompt's
      // keys and values once. Appended at the end instead, a GRPO step's first run held every
      // parent and the second only forks: its attention read 64 prompts against 37 and took
      // ~15% longer (Zen 5 VM, 64 x 8 samples, 2 threads).
      auto after = std::find_if(running_.begin(), running_.end(), [seq](const auto& p) { return p.get() == seq; });
      VROLL_CHECK(after != running_.end(), "sequence {} forks but is not running", seq->id);
      ++after;
      const int n = seq->request->request.n;
      for (int k = n - seq->num_forks_pending; k < n; ++k) {
        auto child = std::make_unique<Sequence>(next_seq_id_++, seq->request, k, seq->arrival);
        child->tokens = seq->tokens;
        child->num_prompt_tokens = seq->num_prompt_tokens;
        child->num_computed_tokens = seq->num_computed_tokens + s.num_new_tokens;
        child->num_cached_prompt_tokens = seq->num_cached_prompt_tokens;
        child->has_first_schedule = true;
        child->first_scheduled = seq->first_scheduled;
        child->status = SequenceStatus::kRunning;
        child->was_admitted = true;
        kv_->Fork(seq->id, child->id);
        targets.push_back({row, child.get()});
        after = running_.insert(after, std::move(child)) + 1;
      }
      seq->num_forks_pending = 0;
    }
    ++row;
  }
  return targets;
}

bool Scheduler::IsStop(const Sequence& seq, TokenId token) const {
  const auto& stops = seq.request->request.sampling.stop_token_ids;
  return std::find(stops.begin(), stops.end(), token) != stops.end();
}

std::vector<SampleResult> Scheduler::Commit(const StepPlan& plan, const std::vector<SamplingTarget>& targets,
                                            const std::vector<TokenChoice>& choices, PolicyVersion version) {
  VROLL_CHECK(targets.size() == choices.size(), "{} targets, {} choices", targets.size(), choices.size());
  for (const ScheduledSequence& s : plan.seqs) {
    s.seq->num_computed_tokens += s.num_new_tokens;
    (void)kv_->InsertIntoPrefixCache(s.seq->id, s.seq->tokens, s.seq->num_computed_tokens);
  }
  std::vector<SampleResult> results;
  const Clock::time_point now = Clock::now();
  for (size_t i = 0; i < targets.size(); ++i) {
    Sequence* seq = targets[i].seq;
    const TokenChoice& c = choices[i];
    const SamplingParams& params = seq->request->request.sampling;
    if (seq->num_output_tokens() == 0) seq->first_token = now;
    if (!std::isfinite(c.logprob)) {
      // NaN or inf logits (e.g. weights that diverged): nothing valid to sample or to report.
      for (SampleResult& r : Finish(seq, FinishReason::kError)) {
        r.error = fmt::format("{} at output token {}: the logits of policy version {} are not finite (NaN or inf)",
                              kNonFiniteLogits, r.output_ids.size(), version);
        results.push_back(std::move(r));
      }
      continue;
    }
    const bool stop = IsStop(*seq, c.token);
    if (!stop || params.include_stop_token) seq->AppendToken(c.token, c.logprob, version);
    if (stop) {
      for (SampleResult& r : Finish(seq, FinishReason::kStop)) results.push_back(std::move(r));
    } else if (seq->num_output_tokens() >= params.max_new_tokens ||
               static_cast<int32_t>(seq->tokens.size()) >= config_.max_model_len) {
      for (SampleResult& r : Finish(seq, FinishReason::kLength)) results.push_back(std::move(r));
    }
  }
  return results;
}

void Scheduler::RemoveRunning(Sequence* seq) {
  auto it = std::find_if(running_.begin(), running_.end(), [seq](const auto& p) { return p.get() == seq; });
  VROLL_CHECK(it != running_.end(), "sequence {} is not running", seq->id);
  running_.erase(it);
}

std::vector<Sequence*> Scheduler::running() const {
  std::vector<Sequence*> out;
  for (const auto& s : running_) out.push_back(s.get());
  return out;
}

std::vector<Sequence*> Scheduler::InFlight() const {
  std::vector<Sequence*> out = running();
  for (const auto& s : waiting_) {
    if (s->was_admitted) out.push_back(s.get());
  }
  return out;
}

bool Scheduler::HasInFlight() const {
  return !running_.empty() ||
         std::any_of(waiting_.begin(), waiting_.end(), [](const auto& s) { return s->was_admitted; });
}

void Scheduler::Requeue(Sequence* seq, RequeueReason reason) {
  auto it = std::find_if(running_.begin(), running_.end(), [seq](const auto& p) { return p.get() == seq; });
  if (it != running_.end()) {
    std::unique_ptr<Sequence> owned = std::move(*it);
    running_.erase(it);
    if (kv_->HasSequence(seq->id)) kv_->Release(seq->id);
    seq->status = SequenceStatus::kWaiting;
    // The waiting queue stays in arrival order (ties: sequence id): the requeued sequence goes
    // before every newer one, so however many are requeued, and in whatever order, the oldest
    // is readmitted first.
    auto at = std::find_if(waiting_.begin(), waiting_.end(), [seq](const auto& w) {
      return std::tie(w->arrival, w->id) > std::tie(seq->arrival, seq->id);
    });
    waiting_.insert(at, std::move(owned));
  }
  VROLL_CHECK(seq->status == SequenceStatus::kWaiting, "requeue of sequence {} that is neither running nor waiting",
              seq->id);
  seq->num_computed_tokens = 0;
  switch (reason) {
    case RequeueReason::kPreempted:
      ++seq->num_preemptions;
      ++num_preemptions_;
      break;
    case RequeueReason::kRecompute:
      break;
    case RequeueReason::kRestart:
      seq->tokens.resize(seq->num_prompt_tokens);
      seq->logprobs.clear();
      seq->version_spans.clear();
      seq->rng = SequenceRng(seq->request->seed, static_cast<uint64_t>(seq->sample_index));
      break;
  }
}

std::vector<SampleResult> Scheduler::Finish(Sequence* seq, FinishReason reason) {
  std::unique_ptr<Sequence> owned;
  auto from_running = std::find_if(running_.begin(), running_.end(), [seq](const auto& p) { return p.get() == seq; });
  if (from_running != running_.end()) {
    owned = std::move(*from_running);
    running_.erase(from_running);
  } else {
    auto from_waiting = std::find_if(waiting_.begin(), waiting_.end(), [seq](const auto& p) { return p.get() == seq; });
    VROLL_CHECK(from_waiting != waiting_.end(), "finish of unknown sequence {}", seq->id);
    owned = std::move(*from_waiting);
    waiting_.erase(from_waiting);
  }
  if (kv_->HasSequence(seq->id)) kv_->Release(seq->id);
  seq->status = SequenceStatus::kFinished;
  seq->finish_reason = reason;
  const Clock::time_point now = Clock::now();
  std::vector<SampleResult> results = {seq->MakeResult(now)};
  // A group that never forked still owes a result to each of its other samples.
  const int n = seq->request->request.n;
  for (int k = n - seq->num_forks_pending; k < n; ++k) {
    SampleResult r = seq->MakeResult(now);
    r.sample_index = k;
    results.push_back(std::move(r));
  }
  seq->request->num_unfinished -= static_cast<int>(results.size());
  return results;
}

std::vector<SampleResult> Scheduler::AbortRequest(const std::string& request_id, FinishReason reason) {
  std::vector<Sequence*> victims;
  for (const auto& s : waiting_) {
    if (s->request->request.request_id == request_id) victims.push_back(s.get());
  }
  for (const auto& s : running_) {
    if (s->request->request.request_id == request_id) victims.push_back(s.get());
  }
  std::vector<SampleResult> results;
  for (Sequence* seq : victims) {
    for (SampleResult& r : Finish(seq, reason)) results.push_back(std::move(r));
  }
  return results;
}

}  // namespace vroll::rollout
