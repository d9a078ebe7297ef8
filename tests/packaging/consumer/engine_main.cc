// Uses an installed vroll's engine in-process, as README "In-process, C++" does: the embedded
// default model, a group of samples with their logprobs, then a weight update and samples
// tagged with the new version. Needs no worker and no network.
#include <cmath>
#include <cstdio>
#include <vector>

#include "policy/default_model.h"
#include "rollout/engine.h"

int main() {
  const vroll::policy::Checkpoint checkpoint = vroll::policy::MakeDefaultCheckpoint();
  vroll::rollout::EngineConfig config;
  config.kv_cache_bytes = 8 << 20;
  vroll::rollout::Engine engine(checkpoint, config);
  vroll::rollout::Request request;
  request.request_id = "q";
  request.prompt = {1, 72, 105};
  request.n = 4;
  request.sampling.max_new_tokens = 8;
  auto check = [](const std::vector<vroll::rollout::SampleResult>& results, vroll::PolicyVersion version) {
    if (results.size() != 4) return false;
    for (const auto& r : results) {
      if (r.output_ids.empty() || r.logprobs.size() != r.output_ids.size() || r.policy_version != version) return false;
      for (float lp : r.logprobs) {
        if (!std::isfinite(lp) || lp > 0) return false;
      }
    }
    return true;
  };
  if (!check(engine.Generate({request}), 0)) {
    std::fprintf(stderr, "version 0 samples are not as expected\n");
    return 1;
  }
  const vroll::rollout::UpdateResult ack = engine.UpdateWeights(checkpoint.weights, 1, vroll::rollout::InFlightMode::kDrain);
  if (!ack.ok || ack.version != 1) {
    std::fprintf(stderr, "update refused: %s\n", ack.error.c_str());
    return 1;
  }
  if (!check(engine.Generate({request}), 1)) {
    std::fprintf(stderr, "version 1 samples are not as expected\n");
    return 1;
  }
  std::printf("vroll engine consumer ok: 4 samples at version 0, 4 at version 1\n");
  return 0;
}
