#pragma once
// The vroll wire protocol, version 1 (docs/PROTOCOL.md): one typed struct per message and the
// msgpack codec of the header frame. Raw payload frames (update_chunk's tensor bytes) never pass
// through here: the header says where they go, the bytes stay in their own ZeroMQ frame.
//
// Decoding is total: any byte string (not msgpack, not a map, wrong types, missing fields, unknown
// types, huge arrays, out-of-range numbers) yields either a message or a DecodeError naming the
// field; it never throws, aborts or allocates more than a small multiple of the input size.
// Checks that need the model (ids in the vocabulary, prompt within the context, n within
// max_num_seqs, a manifest matching the parameters) are the worker's, not the decoder's.
//
// Torch-free; no msgpack or ZeroMQ headers leak out of this file.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "policy/policy_version.h"
#include "policy/weight_update.h"
#include "rollout/engine.h"
#include "rollout/request.h"

namespace vroll::transport {

/// The `v` every header carries.
inline constexpr int kProtocolVersion = 1;

/// Largest header frame (frame 0) either side decodes, bytes. A header is small (a prompt of
/// 800k tokens, a manifest of thousands of tensors fit); the cap bounds the decoder's memory,
/// which is at most ~16x the frame (one msgpack object per byte).
inline constexpr size_t kMaxHeaderBytes = size_t{4} << 20;

/// Error codes of an `error` reply; the wire names are ErrorCodeName's.
enum class ErrorCode {
  kBadMessage,    ///< "bad_message": not msgpack, not a map, wrong frame count
  kBadVersion,    ///< "bad_version": `v` is not 1
  kUnknownType,   ///< "unknown_type"
  kBadField,      ///< "bad_field": missing, wrong type or out of range; `field` names it
  kTooLarge,      ///< "too_large": a frame over max_message_bytes (or a header over kMaxHeaderBytes)
  kOverloaded,    ///< "overloaded": max_pending_requests reached
  kUnauthorized,  ///< "unauthorized": this CURVE key may not do this
  kUnknownUpdate, ///< "unknown_update": no open update has this update_id
  kUpdateFailed,  ///< "update_failed": the update is poisoned (the message says why)
  kBusy,          ///< "busy": another update is open or being applied
  kShuttingDown,  ///< "shutting_down"
};

const char* ErrorCodeName(ErrorCode code);
/// ErrorCodeName's names -> code; nullopt for anything else.
std::optional<ErrorCode> ParseErrorCode(std::string_view name);

/// Why a header frame was refused. `field` names the offending field with its path
/// (`sampling.top_p`, `prompt[3]`, `tensors[2].shape[0]`), empty when the frame as a whole is bad.
/// `id` is the message's correlation id when it could be read (to echo in the error reply).
struct DecodeError {
  ErrorCode code = ErrorCode::kBadMessage;
  std::string field;
  std::string message;
  std::string id;
};

// ---- Client -> worker ----------------------------------------------------------------------------
// Every message has `id`: the client's correlation id, echoed in each reply (may be empty).

/// "generate": `request` carries every wire field; sampling.seed on the wire is request.seed
/// (SamplingParams::seed is not used on the wire).
struct GenerateMsg {
  std::string id;
  rollout::Request request;
};

/// "abort": end the request's unfinished samples.
struct AbortMsg {
  std::string id;
  std::string request_id;
};

/// "update_begin": opens update `update_id` with its manifest.
struct UpdateBeginMsg {
  std::string id;
  std::string update_id;
  rollout::InFlightMode mode = rollout::InFlightMode::kDrain;
  policy::UpdateManifest manifest;  ///< version, tensors, partial, rope_layout
  /// The policy version the update was made against: when set, a worker running any other
  /// version refuses the begin (bad_field base_version). A partial update changes some
  /// parameters of the weights the worker has, so workers on different versions would end up on
  /// the same version number with different weights; the Python client sets it for partial
  /// pushes (docs/PROTOCOL.md).
  std::optional<PolicyVersion> base_version;
};

/// "update_chunk": bytes [offset, offset + frame size) of tensor `name`; the bytes are frame 1.
struct UpdateChunkMsg {
  std::string id;
  std::string update_id;
  std::string name;
  uint64_t offset = 0;
};

/// "update_commit": verify; apply too unless `apply` is false (two-phase push).
struct UpdateCommitMsg {
  std::string id;
  std::string update_id;
  bool apply = true;
};

/// "update_apply": apply a verified update (phase two).
struct UpdateApplyMsg {
  std::string id;
  std::string update_id;
};

/// "update_abort": discard an open update.
struct UpdateAbortMsg {
  std::string id;
  std::string update_id;
};

/// The header-only requests and their acknowledgements.
enum class ControlKind { kPause, kResume, kFlushCache, kStats, kHealth, kShutdown };

/// "pause", "resume", "flush_cache", "stats", "health", "shutdown".
const char* ControlKindName(ControlKind kind);

/// "pause", "resume", "flush_cache", "stats", "health" or "shutdown" (no fields).
struct ControlMsg {
  std::string id;
  ControlKind kind = ControlKind::kHealth;
};

using ClientMessage = std::variant<GenerateMsg, AbortMsg, UpdateBeginMsg, UpdateChunkMsg, UpdateCommitMsg,
                                   UpdateApplyMsg, UpdateAbortMsg, ControlMsg>;

// ---- Worker -> client ----------------------------------------------------------------------------

/// "accepted": the generate request was queued.
struct AcceptedMsg {
  std::string id;
  std::string request_id;
  PolicyVersion policy_version = 0;  ///< the worker's version when accepted
};

/// "sample": one finished sample (exactly one per accepted sample).
struct SampleMsg {
  std::string id;
  rollout::SampleResult result;
};

/// "abort_ack".
struct AbortAckMsg {
  std::string id;
  std::string request_id;
};

enum class UpdateStage { kBegun, kVerified, kApplied, kAborted };
/// "begun", "verified", "applied", "aborted".
const char* UpdateStageName(UpdateStage stage);

/// "update_ack".
struct UpdateAckMsg {
  std::string id;
  std::string update_id;
  UpdateStage stage = UpdateStage::kBegun;
  PolicyVersion version = 0;      ///< the version now in use
  uint64_t weights_checksum = 0;  ///< applied only: policy::WeightsChecksum of the weights in use
  int num_drained = 0;
  int num_aborted = 0;
  int num_restarted = 0;
  int num_recomputed = 0;
  double wait_ms = 0;   ///< applied only: submit -> swap
  double stall_ms = 0;  ///< applied only: generation paused for the swap
  /// begun and verified only (0 otherwise): the worker aborts the update after this many
  /// milliseconds without a message of it (WorkerConfig::update_timeout_ms); a trainer that
  /// waits longer (for other workers) repeats update_commit apply=false to keep it.
  uint64_t update_timeout_ms = 0;
};

/// "pause_ack", "resume_ack", "flush_cache_ack", "shutdown_ack" (kind kStats/kHealth are not acks:
/// their replies are StatsMsg and HealthMsg).
struct ControlAckMsg {
  std::string id;
  ControlKind kind = ControlKind::kPause;
};

/// "stats": a snapshot of the engine's counters (the timing fields, busy_seconds, the
/// schedule/forward/sample/commit/decode seconds and forward_parts, are not on the wire).
struct StatsMsg {
  std::string id;
  rollout::EngineStats stats;
};

/// The model summary in a "health" reply.
struct ModelInfo {
  int vocab_size = 0;
  int max_seq_len = 0;    ///< the model's context (tokens)
  int dim = 0;
  int n_layers = 0;
  /// The longest sequence (prompt + output, tokens) the worker runs: max_seq_len, or less when
  /// its KV cache cannot hold a full-context sequence (rollout::Engine::max_model_len). Replies
  /// without the field (older workers) read as max_seq_len.
  int max_model_len = 0;
  /// How the model rotates query/key pairs (RoPE), which fixes the row order of the q_proj and
  /// k_proj weights a push must send: "interleaved" (llama2.c checkpoints) or "half_split"
  /// (Hugging Face checkpoints; rotate_half). Empty in replies of older workers.
  std::string rope_layout;
};

/// "health".
struct HealthMsg {
  std::string id;
  bool ok = true;
  PolicyVersion policy_version = 0;
  ModelInfo model;
  int protocol_version = kProtocolVersion;
  bool paused = false;  ///< the worker was sent pause and not resume: it accepts requests, runs none
  /// The version of the weight update open on the worker (begun, verified or being applied);
  /// 0 when none is: a worker behind a client's min_policy_version with an update to it open is
  /// catching up, one without is not (clients route around it).
  PolicyVersion update_version = 0;
  /// The most samples one generate request may ask for (the worker's max_num_seqs: a larger n is
  /// refused, bad_field "n"); 0: not reported (a worker older than the field).
  int max_num_seqs = 0;
  /// The worker's KV cache element type: "float32", "float16" or "bfloat16" (16 bits: the
  /// logprobs are those of a model whose keys and values are rounded); "": not reported.
  std::string kv_cache_dtype = {};
};

/// "error".
struct ErrorMsg {
  std::string id;
  ErrorCode code = ErrorCode::kBadMessage;
  std::string field;
  std::string message;
  /// update_failed about one tensor (a bad chunk, an incomplete tensor, a checksum mismatch, a
  /// non-finite value, a manifest entry the staging refused): its canonical name; else empty.
  std::string tensor;
};

using WorkerMessage = std::variant<AcceptedMsg, SampleMsg, AbortAckMsg, UpdateAckMsg, ControlAckMsg, StatsMsg,
                                   HealthMsg, ErrorMsg>;

// ---- Codec ---------------------------------------------------------------------------------------

/// The wire `type` of a message.
const char* TypeName(const ClientMessage& message);
const char* TypeName(const WorkerMessage& message);
/// The correlation id a message carries.
const std::string& MessageId(const ClientMessage& message);
const std::string& MessageId(const WorkerMessage& message);

/// The header frame (a msgpack map) of `message`. Never fails. Floats: logprobs as float32,
/// everything else float64.
std::string EncodeClientMessage(const ClientMessage& message);
std::string EncodeWorkerMessage(const WorkerMessage& message);

/// A decoded header: `message` when it decoded, else `error`.
template <class Message>
struct [[nodiscard]] Decoded {
  std::optional<Message> message;
  DecodeError error;  ///< meaningful only when !ok()
  bool ok() const { return message.has_value(); }
};

/// Decodes a header frame sent to a worker. Total (see the top of this file): returns `error`
/// with code kBadMessage (not msgpack, trailing bytes, not a map), kTooLarge (over
/// kMaxHeaderBytes; the error still carries the header's top-level "id" when one is found by a
/// bounded scan), kBadVersion, kUnknownType (including worker -> client types) or kBadField.
/// Integers accept any msgpack integer in range; float fields also accept integers.
/// Thread safety: reentrant.
Decoded<ClientMessage> DecodeClientMessage(const void* data, size_t size);

/// The top-level "id" string of a msgpack map, found by a bounded scan that builds no objects
/// (O(1) memory, nesting up to 32, stops at the id): how a header too large to decode is still
/// answered under its own id. Empty when there is none, the bytes are not such a map, or the id
/// is not valid UTF-8. Thread safety: reentrant.
std::string PeekTopLevelId(const void* data, size_t size);

/// Decodes a header frame sent to a client; the same contract as DecodeClientMessage.
Decoded<WorkerMessage> DecodeWorkerMessage(const void* data, size_t size);

/// Offset of the first byte of `s` that does not start a well-formed UTF-8 sequence (RFC 3629,
/// section 4: no overlong forms, surrogates or code points above U+10FFFF), or npos when `s` is
/// valid UTF-8. Every msgpack str field is checked with it (bad_field "... is not valid UTF-8").
size_t FirstInvalidUtf8(std::string_view s);

/// Whether the frame count is right for `message`'s type: update_chunk carries exactly one raw
/// frame after the header, every other message none.
size_t NumPayloadFrames(const ClientMessage& message);

}  // namespace vroll::transport
