#include "rollout/sequence.h"

namespace vroll::rollout {

namespace {
double Ms(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}
}  // namespace

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAborted: return "aborted";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

Sequence::Sequence(cache::SeqId id_in, std::shared_ptr<RequestState> request_in, int sample_index_in, uint64_t arrival_in)
    : id(id_in),
      request(std::move(request_in)),
      sample_index(sample_index_in),
      arrival(arrival_in),
      rng(request->seed, static_cast<uint64_t>(sample_index_in)) {}

void Sequence::AppendToken(TokenId token, float logprob, PolicyVersion version) {
  const int32_t index = num_output_tokens();
  tokens.push_back(token);
  logprobs.push_back(logprob);
  if (!version_spans.empty() && version_spans.back().version == version && version_spans.back().end == index) {
    version_spans.back().end = index + 1;
  } else {
    version_spans.push_back({index, index + 1, version});
  }
}

SampleResult Sequence::MakeResult(Clock::time_point now) const {
  SampleResult r;
  r.request_id = request->request.request_id;
  r.sample_index = sample_index;
  r.output_ids.assign(tokens.begin() + num_prompt_tokens, tokens.end());
  r.logprobs = logprobs;
  r.finish_reason = finish_reason;
  r.version_spans = version_spans;
  r.policy_version = version_spans.empty() ? 0 : version_spans.back().version;
  r.num_prompt_tokens = num_prompt_tokens;
  r.num_cached_prompt_tokens = num_cached_prompt_tokens;
  r.num_preemptions = num_preemptions;
  const Clock::time_point submit = request->submit_time;
  r.queue_ms = has_first_schedule ? Ms(submit, first_scheduled) : Ms(submit, now);
  r.first_token_ms = r.output_ids.empty() ? 0 : Ms(submit, first_token);
  r.total_ms = Ms(submit, now);
  return r;
}

}  // namespace vroll::rollout
