#pragma once
// The weight-update transaction: stages the bytes of a new policy pushed by the trainer, verifies
// them (complete, exactly once, right shapes and dtypes, matching checksums) and converts them to
// fp32, all without touching the model. Torch-free and transport-free: a transport decodes
// begin/write/commit/abort frames into calls on WeightUpdateStaging; the engine thread applies
// verified() to the model at its safe point and then calls Finish().
//
// Life of one update (states of WeightUpdateStaging):
//
//            Begin ok                   Verify ok                 Finish (after apply)
//   kIdle ------------> kStaging -------------------> kVerified ----------------------> kIdle
//     |                  |  Write ok (stays)             |
//     | Begin fails      | any failed call               | any failed call
//     v                  v                               v
//   kPoisoned <----------+-------------------------------+
//     |  Write / Verify: refused, the error repeats the poisoning cause
//     |  Begin: starts a fresh transaction (the poisoned one is discarded)
//     +--> Abort (from any state) --> kIdle
//
// Nothing is ever published from kStaging or kPoisoned: the only way out with data is verified()
// in kVerified. Every tensor buffer is kept per parameter across transactions, so memory stays
// flat over any number of updates (shapes are fixed by the model).
//
// Wire conventions (all little-endian; weight_update.cc static_asserts a little-endian host):
//   float32  4 bytes per element, IEEE binary32.
//   float16  2 bytes per element, IEEE binary16; converted exactly (subnormals, inf, NaN payloads).
//   bfloat16 2 bytes per element, the upper 16 bits of a binary32; converted by shifting left 16.
// A manifest checksum is XXH3_64bits (seed 0) over the tensor's raw bytes as sent, in its source
// dtype: see TensorChecksum().

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "policy/model_config.h"
#include "policy/policy_version.h"
#include "policy/weights.h"
#include "policy/xxh3.h"

namespace vroll::policy {

/// A caller's mistake at this API's edge (not an expected outcome of a bad update, which is a
/// returned UpdateStatus): duplicate parameter names, a null write pointer, verified() outside
/// kVerified. The message names the offending item.
class WeightUpdateError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// ---------------------------------------------------------------------------------------------
// Element types and conversions.

/// Source dtype of a tensor in an update. The model's parameters are always fp32.
enum class DType { kF32, kF16, kBF16 };

/// "float32"/"fp32", "float16"/"fp16"/"half", "bfloat16"/"bf16" -> DType; anything else (including
/// "float64", "int8", different case) -> nullopt.
std::optional<DType> ParseDType(std::string_view name);

/// Bytes per element: 4, 2, 2. Throws WeightUpdateError for a value outside the enumerators.
size_t DTypeSize(DType dtype);

/// Canonical name: "float32", "float16", "bfloat16" ("invalid(<n>)" outside the enumerators).
std::string DTypeName(DType dtype);

/// IEEE binary16 bits -> the exactly equal float: normals, subnormals (m * 2^-24), +-0, +-inf;
/// NaNs stay NaN with their sign and payload (shifted into the top of the fp32 mantissa).
float HalfToFloat(uint16_t bits);

/// bfloat16 bits -> float: the bits become the upper half of a binary32 (exact, NaNs included).
float BFloat16ToFloat(uint16_t bits);

// ---------------------------------------------------------------------------------------------
// Checksums.

/// The checksum a manifest entry carries: XXH3_64bits(bytes, num_bytes) with seed 0, over the raw
/// bytes of the tensor exactly as sent (source dtype, little-endian, row-major). Python:
/// `xxhash.xxh3_64_intdigest(array.tobytes())`.
uint64_t TensorChecksum(const void* bytes, size_t num_bytes);

/// A borrowed view of one named fp32 tensor, for WeightsChecksum. `data` holds `numel` floats.
struct NamedTensorView {
  std::string_view name;
  const float* data = nullptr;
  size_t numel = 0;
};

/// One named fp32 tensor by its digest: `digest` = TensorChecksum of its 4 * numel data bytes.
struct NamedTensorDigest {
  std::string_view name;
  uint64_t numel = 0;
  uint64_t digest = 0;
};

/// One 64-bit checksum of a set of named fp32 tensors: what the worker reports in an update's
/// acknowledgement so the trainer can check the weights now in use. Definition (seed 0):
///
///   sort the tensors by name, comparing names as byte strings (Python: sorted(names));
///   h = XXH3_64 streaming state, seed 0
///   for each tensor:
///     h.update(u64le(len(name_bytes)))   # 8 bytes
///     h.update(name_bytes)               # UTF-8, no terminator
///     h.update(u64le(4 * numel))         # 8 bytes: number of data bytes the digest covers
///     h.update(u64le(XXH3_64(data)))     # 8 bytes: the tensor's digest, data as float32
///                                        #   little-endian, row-major (= TensorChecksum)
///   return h.digest()
///
/// It is a hash of per-tensor digests, not of the concatenated data, so that it can be assembled
/// without another pass over the weights: for an fp32 tensor the digest is exactly the manifest
/// checksum the trainer already computed and the worker verified on arrival, and a worker keeps
/// the digest of every parameter in use. The length prefixes make the byte stream unambiguous.
/// Shapes are not hashed (they are fixed by the model). An empty set hashes to XXH3_64bits("") =
/// 0x2d06800538d394c2. Worked example: {"a": [1.0, 2.0], "b": [-0.5]}: XXH3_64(0000803f00000040)
/// = 0x4de8d78f7134f4b7, XXH3_64(000000bf) = 0x7d99fbe36c125803, so the 50-byte stream (hex) is
///   0100000000000000 61 0800000000000000 b7f434718fd7e84d
///   0100000000000000 62 0400000000000000 0358126ce3fb997d
/// and hashes to 0xcac5fea618160d40. Throws WeightUpdateError on a duplicate name or a null
/// `data` with numel > 0. Complexity: O(total bytes + n log n).
uint64_t WeightsChecksum(std::vector<NamedTensorView> tensors);

/// WeightsChecksum from per-tensor digests (the same definition, without touching the data).
/// Throws WeightUpdateError on a duplicate name. Complexity: O(n log n).
uint64_t WeightsChecksumFromDigests(std::vector<NamedTensorDigest> tensors);

/// WeightsChecksum over every tensor of `weights` (a WeightMap is already in byte order of names).
uint64_t WeightsChecksum(const WeightMap& weights);

// ---------------------------------------------------------------------------------------------
// The transaction.

/// One tensor of an update, as the trainer announces it in the begin frame.
struct TensorManifestEntry {
  std::string name;            ///< canonical (Hugging Face) parameter name, see weights.h
  DType dtype = DType::kF32;   ///< source dtype of the bytes that will be written
  std::vector<int64_t> shape;  ///< must equal the model parameter's shape
  uint64_t num_bytes = 0;      ///< must equal prod(shape) * DTypeSize(dtype)
  uint64_t checksum = 0;       ///< TensorChecksum of the num_bytes source bytes
};

/// The begin frame of an update.
struct UpdateManifest {
  PolicyVersion version = 0;                 ///< must be > the version in use
  std::vector<TensorManifestEntry> tensors;  ///< each parameter at most once, any order
  bool partial = false;  ///< true: `tensors` may be a subset of the model's parameters
  /// The RoPE layout the q_proj/k_proj rows of `tensors` are in, when the sender declares it
  /// (interleaved: llama2.c and Meta checkpoints; half_split: Hugging Face's rotate_half). Rows in
  /// the other order pass every other check (same shapes, consistent checksums) and make the model
  /// compute garbage, so a declared layout must equal the model's (see
  /// WeightUpdateStaging::set_model_rope_layout); nullopt: not declared, not checked.
  std::optional<RopeLayout> rope_layout;
};

/// One parameter of the model: canonical name and shape. Parameters are fp32.
/// A model that ties lm_head to embed_tokens lists model.embed_tokens.weight and no lm_head.weight;
/// that absence is how WeightUpdateStaging knows the head is tied.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
};

/// Result of a transaction call: ok, or an error message naming the tensor (and the byte offset
/// for a bad write). Expected failures of an update are values, never exceptions.
class [[nodiscard]] UpdateStatus {
 public:
  static UpdateStatus Ok() { return UpdateStatus(true, {}, {}); }
  /// `tensor`: the parameter the error is about, when it is about one (also named in `message`).
  static UpdateStatus Error(std::string message, std::string tensor = {}) {
    return UpdateStatus(false, std::move(message), std::move(tensor));
  }

  bool ok() const { return ok_; }
  /// Empty when ok().
  const std::string& error() const { return error_; }
  /// The canonical name of the tensor the error is about (a bad chunk, an incomplete tensor, a
  /// checksum mismatch, a non-finite value, a manifest entry); empty when ok() or when the error
  /// is about no one tensor. A poisoned transaction's later errors carry its cause's tensor.
  const std::string& tensor() const { return tensor_; }

 private:
  UpdateStatus(bool ok, std::string error, std::string tensor)
      : ok_(ok), error_(std::move(error)), tensor_(std::move(tensor)) {}
  bool ok_;
  std::string error_;
  std::string tensor_;
};

/// A borrowed run of fp32 values: `size()` floats at `data()`.
class FloatSpan {
 public:
  FloatSpan() = default;
  FloatSpan(const float* data, size_t size) : data_(data), size_(size) {}
  const float* data() const { return data_; }
  size_t size() const { return size_; }
  float operator[](size_t i) const { return data_[i]; }
  const float* begin() const { return data_; }
  const float* end() const { return data_ + size_; }

 private:
  const float* data_ = nullptr;
  size_t size_ = 0;
};

/// A verified tensor: the model parameter it replaces and its staged fp32 values
/// (prod(param->shape) floats, row-major). Both pointers are owned by the WeightUpdateStaging
/// (the values may lie in a buffer given to UseValueBuffers) and stay valid until its next
/// Begin, Abort or Finish.
struct VerifiedTensor {
  const ParamSpec* param = nullptr;
  const FloatSpan* values = nullptr;
  /// TensorChecksum of the 4 * numel bytes of *values (the fp32 values, not the source bytes):
  /// the tensor's digest in WeightsChecksumFromDigests. Computed while staging, never re-read.
  uint64_t values_checksum = 0;
  /// Index of the first NaN or infinite value, if any: the staging converts exactly and does not
  /// judge values; the engine refuses such an update (found while staging, never re-read).
  std::optional<uint64_t> first_nonfinite;
};

/// Ok when every verified tensor is finite; otherwise an error "tensor NAME: element I is nan
/// (weights must be finite)" with tensor() NAME, for the first tensor (in `verified` order)
/// holding a NaN or infinity. Reads no weights but that one element (first_nonfinite was found
/// while staging).
UpdateStatus CheckWeightsFinite(const std::vector<VerifiedTensor>& verified);

/// Told about a WeightUpdateStaging's transaction as it goes, so that work on the staged values
/// (packing them for the CPU GEMM: policy/weight_prepack.h) overlaps the transfer of the rest,
/// and can be done on each block of values while it is still in cache. Every call comes from the
/// staging's owner thread, inside the staging call named beside it; an observer must not call
/// back into the staging. Nothing an observer sees is verified before OnVerified: it works on
/// staging memory only and publishes nothing.
///
///   Begin ok -> OnBegin, then PrefixGridOf for each manifest parameter
///   Write (or Verify) growing a parameter's final fp32 prefix -> OnPrefix, block by block
///   Write completing a tensor (or Verify, for one never completed by a write) -> OnStaged
///   Verify ok -> OnVerified
///   Abort / Finish / the Abort that opens a Begin -> OnEnd (also when no transaction was open)
///
/// The final prefix of a parameter: elements [0, e) whose fp32 values lie final in its staged
/// buffer. For an fp32 source it grows as bytes join the written prefix [0, p) (e = p / 4): block
/// by block as an in-order write is copied and hashed, the value block then being the received
/// bytes (cache-hot); or at once when a write fills the gap before bytes written ahead (the
/// values then read from the staged buffer). For an fp16/bf16 source it grows only when the
/// tensor is complete, block by block as Finalize converts it (the converted block, hot).
/// Blocks end on the parameter's PrefixGrid where they can (an in-order write of one chunk
/// yields whole grid blocks, plus partial ones at the chunk's ends).
///
///   staged  [0 ........ elem_begin)[elem_begin .... elem_end)[ ... not final yet ... numel)
///           reported before          this OnPrefix: values[0, elem_end - elem_begin)
class StagingObserver {
 public:
  /// Where the staging cuts a parameter's final prefix into OnPrefix blocks: at elements
  /// first_elems + j * step_elems (j >= 0), besides 0 and numel. step_elems == 0: the staging's
  /// own blocks (about 128 KiB).
  struct PrefixGrid {
    uint64_t first_elems = 0;
    uint64_t step_elems = 0;
  };

  virtual ~StagingObserver() = default;
  /// A transaction `transaction_id` (WeightUpdateStaging::transaction_id) opened; it names the
  /// parameters `manifest_params` (indices into params(), ascending).
  virtual void OnBegin(uint64_t transaction_id, const std::vector<size_t>& manifest_params) = 0;
  /// The grid for parameter `index` in the transaction just begun (asked once per manifest
  /// parameter, after OnBegin). Default: the staging's own blocks.
  virtual PrefixGrid PrefixGridOf(size_t /*index*/) { return {}; }
  /// Parameter `index`'s final prefix grew from elem_begin to elem_end elements (see above):
  /// `staged` is its staged buffer (numel floats; elements [0, elem_end) final there until the
  /// transaction ends), `values` holds elements [elem_begin, elem_end) with the same bits,
  /// possibly a cache-hot copy valid only during the call (it may be staged + elem_begin).
  /// Reported in increasing, contiguous ranges, before the OnStaged of the parameter. Default:
  /// ignored.
  virtual void OnPrefix(size_t /*index*/, uint64_t /*elem_begin*/, uint64_t /*elem_end*/, const float* /*staged*/,
                        const float* /*values*/) {}
  /// Parameter `index` is complete: its fp32 values (converted from a 16-bit source) lie final at
  /// `values` (numel floats, the staged buffer) and stay there until the transaction ends. Once
  /// per manifest parameter, after OnPrefix reported all of them; its checksum is checked only
  /// by Verify.
  virtual void OnStaged(size_t index, const float* values) = 0;
  /// Verify succeeded: every manifest parameter was reported by OnStaged.
  virtual void OnVerified() = 0;
  /// The transaction ended or was discarded; staged values may be overwritten from now on.
  virtual void OnEnd() = 0;
};

/// Stages and verifies one weight update at a time for a model with a fixed parameter list.
///
/// Ownership: owns one fp32 buffer per parameter that an update has named (allocated on first
/// use, then reused: a full update holds one fp32 copy of the model) plus one raw buffer per
/// parameter ever sent as fp16/bf16 (2 bytes per element; fp32 sources are written straight into
/// the fp32 buffer). By default buffers are kept for reuse while the object lives (no page faults
/// per update); set_keep_buffers(false) releases them whenever a transaction ends. A parameter
/// given a buffer by UseValueBuffers stages its fp32 values there instead (borrowed, not owned):
/// this is how the engine swaps staged buffers into the model instead of copying them.
///
/// Thread safety: not thread-safe. One owner thread (the engine thread, or a transport thread
/// that hands the verified transaction to the engine thread by message) makes every call.
///
/// Errors: any failed call on an open transaction (kStaging or kVerified) poisons it, so nothing
/// of it can be published; the returned message names the tensor and, for writes, the byte range.
/// See the state diagram at the top of this file.
class WeightUpdateStaging {
 public:
  enum class State { kIdle, kStaging, kVerified, kPoisoned };

  /// `params`: the model's parameters (fp32), in the model's order; verified() follows it.
  /// Throws WeightUpdateError on an empty or duplicate name, a negative dimension, or a tensor
  /// whose fp32 byte size overflows 2^62.
  explicit WeightUpdateStaging(std::vector<ParamSpec> params);

  WeightUpdateStaging(const WeightUpdateStaging&) = delete;
  WeightUpdateStaging& operator=(const WeightUpdateStaging&) = delete;

  /// Opens a transaction for `manifest`. kIdle or kPoisoned -> kStaging on success; on failure
  /// -> kPoisoned (from kIdle/kPoisoned) with the cause recorded. In kStaging or kVerified the
  /// call is refused and poisons the open transaction ("a new begin while one is open").
  /// Refused when: manifest.version <= current_version; a name is not a model parameter; a name
  /// repeats; a shape differs from
  /// the parameter's; a dtype is outside {fp32, fp16, bf16}; num_bytes != numel * dtype size;
  /// the manifest is empty; unless `partial`, a parameter is missing; or manifest.rope_layout is
  /// declared and differs from set_model_rope_layout's (or that was never set).
  /// A model whose head is tied to the embedding (tied_lm_head()) has no lm_head.weight; an update
  /// may still list one, as Hugging Face's state_dict() of a tied model does (and vLLM's loaders
  /// skip), but only beside model.embed_tokens.weight with the same dtype, shape, num_bytes and
  /// checksum: it is then a second copy of the embedding, written like any tensor (whole, once);
  /// Verify checks that its bytes equal the embedding's as received (a head whose bytes differ
  /// poisons the update, naming the first differing element), and the embedding's own values
  /// are what is used. A head whose manifest entry differs, or that comes without the
  /// embedding, is refused with a message saying why. Memory: the copy is held while staged.
  /// Cost: O(manifest) plus, the first time a parameter/dtype is staged, allocating its buffer.
  UpdateStatus Begin(const UpdateManifest& manifest, PolicyVersion current_version);

  /// Copies `num_bytes` bytes of tensor `name`'s source bytes into its buffer at byte `offset`:
  /// the bytes [offset, offset + num_bytes) of the tensor, in any order and chunking (a chunk may
  /// split an element). kStaging -> kStaging. Fails and poisons (kStaging/kVerified -> kPoisoned)
  /// when `name` is not in the manifest, when [offset, offset + num_bytes) leaves [0, entry's
  /// num_bytes), when it overlaps bytes already written, or after Verify. In kIdle or kPoisoned
  /// it is refused and changes nothing. An empty write inside the range is a no-op.
  /// `data` may be null only when num_bytes == 0 (else WeightUpdateError).
  /// Hashing on arrival: the tensor's checksum is computed over its written prefix [0, p) as
  /// that prefix grows. A write at byte p (chunks in order, what every client sends) is copied
  /// block by block as received, with non-temporal stores (fp32 sources are also checked for
  /// NaN/inf there), each block then hashed while in cache and (fp32 sources) handed to the
  /// observer (StagingObserver::OnPrefix, blocks cut on its PrefixGrid), whose work it includes;
  /// bytes written ahead of the prefix are hashed from the staged copy once the gap before them
  /// is filled. Cost: one XXH3 pass and one streaming copy of the bytes, plus O(log k + k) for k
  /// disjoint ranges already written.
  /// The write that completes a tensor also converts a 16-bit source to fp32 (one pass, as
  /// Verify would) and tells the observer (StagingObserver::OnStaged), whose work it includes.
  UpdateStatus Write(const std::string& name, uint64_t offset, const void* data, size_t num_bytes);

  /// The commit check. kStaging -> kVerified when every manifest tensor was written completely
  /// (exactly once follows from the overlap check) and its raw bytes hash to the manifest
  /// checksum (fp16/bf16 sources were converted into the fp32 buffers when their last byte
  /// arrived, see Write), then tells the observer (OnVerified). Otherwise ->
  /// kPoisoned, naming the first incomplete tensor (with its first missing byte range) or the
  /// first checksum mismatch. A second Verify in kVerified (a duplicate commit) also poisons; in
  /// kIdle or kPoisoned it is refused and changes nothing. Each VerifiedTensor carries the digest
  /// of its fp32 values and its first non-finite element.
  /// Cost: the checksums were computed as the bytes arrived (see Write), so for fp32 sources
  /// this is O(tensors), plus what the observer does in OnVerified.
  UpdateStatus Verify();

  /// The verified tensors, in parameter order, for the apply step. Only in kVerified (else
  /// WeightUpdateError). Valid until the next Begin, Abort or Finish.
  const std::vector<VerifiedTensor>& verified() const;

  /// Discards the transaction, whatever its state: any -> kIdle. Buffers are kept for reuse
  /// unless set_keep_buffers(false).
  void Abort();

  /// false: every end of a transaction (Abort, Finish, the Abort in Begin) releases the staging's
  /// own fp32 and raw buffers, so an idle staging holds no copy of the weights (an engine applying
  /// updates in place keeps 2x the weights' size between updates instead of 3x). Default true:
  /// kept for reuse. Borrowed buffers (UseValueBuffers) are never the staging's to release.
  void set_keep_buffers(bool keep) { keep_buffers_ = keep; }

  /// The RoPE layout of the model the updates are for (rollout::Engine sets it from the model's
  /// config). A manifest that declares another layout is refused by Begin; one that declares a
  /// layout while the model's is not set is refused too (it cannot be checked).
  void set_model_rope_layout(RopeLayout layout) { model_rope_layout_ = layout; }

  /// Where each parameter's fp32 values are staged from the next Begin on: `buffers[i]` (parallel
  /// to params(); prod(shape) floats, borrowed: it must stay valid and untouched by others until
  /// the next UseValueBuffers or the staging's end) or, when null, the staging's own buffer. Call
  /// in kIdle or kPoisoned, or in kVerified after the verified values were applied (before
  /// Finish: verified() then points into the new buffers, which is fine since it is not read
  /// again). Throws WeightUpdateError for a wrong count or in kStaging.
  void UseValueBuffers(const std::vector<float*>& buffers);

  /// Closes a transaction whose verified() was applied: kVerified -> kIdle (else
  /// WeightUpdateError). Buffers are kept for reuse unless set_keep_buffers(false).
  void Finish();

  /// Reports this staging's transactions to `observer` (borrowed; null: none) from the next Begin
  /// on. Same states as UseValueBuffers (WeightUpdateError in kStaging).
  void SetObserver(StagingObserver* observer);

  /// A process-wide unique, nonzero id of the open transaction, assigned by a successful Begin
  /// (0 in kIdle, and after a Begin that failed). Lets an applier match work an observer did for
  /// this transaction.
  uint64_t transaction_id() const { return transaction_id_; }

  State state() const { return state_; }
  /// True in kStaging or kVerified (a transaction is open and not poisoned).
  bool active() const { return state_ == State::kStaging || state_ == State::kVerified; }
  /// The manifest version of the open or poisoned transaction (0 when idle).
  PolicyVersion pending_version() const { return pending_version_; }
  /// Why the transaction was poisoned (empty unless kPoisoned).
  const std::string& poison_cause() const { return poison_cause_; }
  /// The model's parameters, as given to the constructor.
  const std::vector<ParamSpec>& params() const { return params_; }
  /// True when the parameter list implies a tied head (embed_tokens present, lm_head absent).
  bool tied_lm_head() const { return tied_lm_head_; }

  /// Bytes of tensor data buffers held (capacities of the fp32 and raw buffers), for memory
  /// flatness checks. Excludes the per-tensor written-range bookkeeping (O(chunks) pairs).
  size_t staging_bytes() const;

  static const char* StateName(State state);

 private:
  /// Per-parameter staging state, parallel to params_.
  struct Slot {
    uint64_t numel = 0;            // immutable after construction
    bool in_manifest = false;      // per transaction from here on
    DType dtype = DType::kF32;
    uint64_t num_bytes = 0;
    uint64_t checksum = 0;
    // Disjoint, sorted, merged half-open byte ranges [begin, end) written so far:
    //   [0 ........ a)   [b ...... c)        [d ... num_bytes)
    //   written           written             written
    std::vector<std::pair<uint64_t, uint64_t>> written;
    std::vector<float> values;  // fp32 staging buffer, numel floats once used (own buffer only)
    float* external = nullptr;  // UseValueBuffers' buffer for this parameter, or null
    FloatSpan span;             // the staged fp32 values: `external` or `values`
    std::vector<uint8_t> raw;   // raw 16-bit source bytes (fp16/bf16 sources only)
    // Hashing on arrival: the source bytes [0, num_hashed_bytes) went into `hash` (a written
    // prefix); fp32 elements [0, num_checked_elems) were checked for NaN/inf, the first bad one
    // being first_nonfinite (kNoElement: none).
    //   [0 ....... num_hashed_bytes)[ ... written or not ... num_bytes)
    //   hashed, checked               hashed later (Write as the gap fills, or Verify)
    std::shared_ptr<Xxh3Stream> hash;  // created on first use, reused
    uint64_t num_hashed_bytes = 0;
    uint64_t num_checked_elems = 0;
    uint64_t first_nonfinite = 0;
    uint64_t values_checksum = 0;  // TensorChecksum of the fp32 values, set by Verify
    // Complete and final (16-bit sources converted; observer told), in this transaction. A
    // converted slot's hash state then holds the fp32 values' hash; the source bytes' digest is
    // kept in source_digest for Verify.
    bool finalized = false;
    uint64_t source_digest = 0;
    // The final fp32 prefix [0, num_prefix_elems) reported to the observer (OnPrefix), and the
    // observer's grid for it (step 0: kHashBlockBytes blocks).
    uint64_t num_prefix_elems = 0;
    StagingObserver::PrefixGrid grid;
  };

  /// Makes a complete slot's fp32 values final: converts a 16-bit source (hashing and checking
  /// the fp32 values), then tells the observer. Idempotent within a transaction.
  void Finalize(size_t index);

  /// Feeds the slot's source bytes [num_hashed_bytes, end) into its hash and, unless
  /// !check_finite (the caller checks them as it copies), checks the fp32 elements that became
  /// whole. `bytes` holds those bytes (the chunk as received); null: read them from the staged
  /// copy (all written).
  static void HashPrefix(Slot& slot, uint64_t end, const uint8_t* bytes = nullptr, bool check_finite = true);

  /// End of the block that starts at element `elem` of the slot's final prefix: the next grid
  /// point after it (or elem + kHashBlockBytes / 4 without a grid), at most numel.
  static uint64_t NextBlockEnd(const Slot& slot, uint64_t elem);

  /// Reports the slot's final prefix growing to `elem_end` to the observer; `values` holds
  /// elements [num_prefix_elems, elem_end) (null: read them from the staged buffer).
  void ReportPrefix(size_t index, uint64_t elem_end, const float* values = nullptr);

  UpdateStatus Poison(std::string cause, std::string tensor = {});
  UpdateStatus CheckManifest(const UpdateManifest& manifest, PolicyVersion current_version);
  std::string UnknownNameMessage(const std::string& name) const;
  std::string Prefix() const;
  static uint8_t* SourceBytes(Slot& slot);
  static float* Values(Slot& slot) { return slot.external != nullptr ? slot.external : slot.values.data(); }

  // Immutable after construction.
  std::vector<ParamSpec> params_;
  std::unordered_map<std::string, size_t> index_by_name_;
  bool tied_lm_head_ = false;
  std::optional<RopeLayout> model_rope_layout_;  // set_model_rope_layout

  // Transaction state (owner thread only).
  bool keep_buffers_ = true;
  State state_ = State::kIdle;
  PolicyVersion pending_version_ = 0;
  std::string poison_cause_;
  std::string poison_tensor_;  // the tensor of poison_cause_, if it is about one
  std::vector<Slot> slots_;             // parallel to params_; never resized after construction
  std::vector<size_t> manifest_slots_;  // slot indices in manifest order (capacity reused)
  // lm_head.weight listed in a tied model's update as a copy of the embedding (CheckManifest):
  // the byte ranges written so far and the bytes as received, compared with the embedding's
  // source bytes at Verify, then unused (the buffer is kept for the next update).
  struct TiedHead {
    bool in_manifest = false;
    uint64_t num_bytes = 0;
    std::vector<std::pair<uint64_t, uint64_t>> written;
    std::vector<uint8_t> bytes;
  };
  TiedHead tied_head_;
  std::vector<VerifiedTensor> verified_;
  uint64_t transaction_id_ = 0;
  StagingObserver* observer_ = nullptr;  // borrowed, see SetObserver
};

/// How received fp32 bytes are copied into the staging buffer (non-temporal stores) and checked
/// for NaN/inf: "avx512" or "avx2" (checked in the copy's registers), or "sse2" (copied, then
/// scanned in a second pass; a plain memcpy on builds without SSE2). Chosen once by CPU unless a
/// test forced a path (below); the staged bytes and the first non-finite element found do not
/// depend on it. For logs and tests.
const char* StagingCopyPath();

namespace detail {
/// Makes staging copies started afterwards use the named path ("sse2", "avx2", "avx512"), or the
/// CPU's choice again for "". Returns false (and changes nothing) for a path this CPU cannot run
/// or an unknown name. Not for use while a staging copy runs on another thread. For tests that
/// compare the paths.
bool ForceStagingCopyPathForTesting(const std::string& name);
}  // namespace detail

}  // namespace vroll::policy
