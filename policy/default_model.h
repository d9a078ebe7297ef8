#pragma once
// The embedded default policy: a model vroll creates itself, so that every program runs on a
// machine without ../shared or any download.

#include <cstdint>
#include <string>

#include "policy/tokenizer.h"
#include "policy/weights.h"

namespace vroll::policy {

/// Shape of the default model: dim 64, hidden 172, 4 layers, 8 heads, 4 kv heads (GQA),
/// vocab 259 (byte-level), 256 positions, tied head, interleaved RoPE.
ModelConfig DefaultModelConfig();

/// A seeded random Llama of DefaultModelConfig(): weights ~ N(0, 0.02^2) from a fixed
/// generator (std::mt19937_64(seed) with a Box-Muller transform, so it is the same on every
/// machine), norms 1. Same seed, same bits.
Checkpoint MakeDefaultCheckpoint(uint64_t seed = 0);

/// A seeded random Llama of any valid shape, drawn as MakeDefaultCheckpoint draws (weights
/// ~ N(0, std^2), norms 1). Throws ConfigError on an invalid config.
Checkpoint MakeRandomCheckpoint(const ModelConfig& config, uint64_t seed, double std = 0.02);

/// Byte-level tokenizer matching the default model (Tokenizer::ByteLevel()).
Tokenizer DefaultTokenizer();

/// One line for --help and logs.
std::string DefaultModelDescription();

}  // namespace vroll::policy
