#!/usr/bin/env bash
# vroll-offline end to end on the embedded default model: --kv-cache-dtype reaches the engine (a
# 16-bit cache holds twice the blocks of the same memory, as the printed stats show), every sample
# is printed, every spelling of a dtype gives its blocks, --block-size changes the block count but
# not the samples, and a bad dtype name is refused naming the option.
set -u
BIN="$1"
err=$(mktemp)
trap 'rm -f "$err"' EXIT
blocks() { sed -n 's/.* of \([0-9]*\) blocks, prefix hit rate.*/\1/p'; }
declare -A num_blocks
for dtype in float32 float16 bfloat16; do
  out=$(VROLL_LOG_LEVEL=warn "$BIN" --n 3 --max-new-tokens 6 --seed 2 --kv-cache-dtype "$dtype" 2>"$err") ||
    { echo "$dtype: vroll-offline failed:"; cat "$err"; exit 1; }
  samples=$(grep -c '^\[prompt[0-9]* #[0-9]*\] v0 ' <<<"$out")
  [ "$samples" -eq 6 ] || { echo "$dtype: $samples samples printed, want 2 prompts x 3:"; echo "$out"; exit 1; }
  num_blocks[$dtype]=$(blocks <<<"$out")
  [ "$dtype" = float32 ] && ref_out=$out
  [ -n "${num_blocks[$dtype]}" ] || { echo "$dtype: no block count in:"; echo "$out"; exit 1; }
done
for dtype in float16 bfloat16; do
  b=${num_blocks[$dtype]} b32=${num_blocks[float32]}
  if [ "$b" -lt $((2 * b32)) ] || [ "$b" -gt $((2 * b32 + 1)) ]; then
    echo "$dtype cache: $b blocks, want twice float32's $b32 (the option did not reach the engine?)"; exit 1
  fi
done
# --block-size: 32 holds half the blocks of 16 in the same memory, and 1, 16 and 32 print the same
# samples (tokens and mean logprobs; the cached prompt token counts follow the block size).
samples() { sed 's/, cached prompt tokens [0-9]*$//'; }
declare -A by_block_size
for bs in 1 16 32; do
  out=$(VROLL_LOG_LEVEL=warn "$BIN" --n 3 --max-new-tokens 6 --seed 2 --block-size "$bs" 2>"$err") ||
    { echo "--block-size $bs: vroll-offline failed:"; cat "$err"; exit 1; }
  by_block_size[$bs]=$(blocks <<<"$out")
  [ "$(samples <<<"$out" | grep -v ' blocks, ')" = "$(samples <<<"$ref_out" | grep -v ' blocks, ')" ] ||
    { echo "--block-size $bs prints other samples:"; echo "$out"; echo "--- block size 16:"; echo "$ref_out"; exit 1; }
done
[ "${by_block_size[32]}" -eq $((by_block_size[16] / 2)) ] ||
  { echo "--block-size 32: ${by_block_size[32]} blocks, want half of ${by_block_size[16]}"; exit 1; }
# The other spellings (vroll-convert-hf's f16 among them) give the same cache.
for alias in fp32:float32 f32:float32 fp16:float16 f16:float16 half:float16 bf16:bfloat16; do
  out=$(VROLL_LOG_LEVEL=warn "$BIN" --n 1 --max-new-tokens 1 --kv-cache-dtype "${alias%%:*}" 2>"$err") ||
    { echo "${alias%%:*}: vroll-offline failed:"; cat "$err"; exit 1; }
  b=$(blocks <<<"$out")
  [ "$b" = "${num_blocks[${alias#*:}]}" ] || { echo "${alias%%:*}: $b blocks, ${alias#*:} has ${num_blocks[${alias#*:}]}"; exit 1; }
done
if "$BIN" --kv-cache-dtype float8 >/dev/null 2>"$err"; then echo "--kv-cache-dtype float8 accepted"; exit 1; fi
grep -q -- "--kv-cache-dtype" "$err" || { echo "error does not name --kv-cache-dtype:"; cat "$err"; exit 1; }
echo "ok: blocks float32 ${num_blocks[float32]}, float16 ${num_blocks[float16]}, bfloat16 ${num_blocks[bfloat16]}"
