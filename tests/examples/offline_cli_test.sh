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
samples() { sed 's/, cached prompt tokens [0-9]*$//' | paste - - | sort; }  # printed in completion order
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
# --jsonl: one object per sample, matching what is printed (token count, mean logprob, version),
# with a logprob per output token; no raw control bytes reach the terminal (the default model's
# byte tokens include ESC and BEL; helper-76); a lost stdout is an error, not exit 0.
jsonl=$(mktemp) printed=$(mktemp)
trap 'rm -f "$err" "$jsonl" "$printed"' EXIT
out=$(VROLL_LOG_LEVEL=warn "$BIN" --n 8 --max-new-tokens 40 --seed 2 --jsonl "$jsonl" 2>"$err") ||
  { echo "--jsonl: vroll-offline failed:"; cat "$err"; exit 1; }
if LC_ALL=C grep -q $'[\x01-\x08\x0b\x0c\x0e-\x1f\x7f]' <<<"$out"; then echo "control bytes printed:"; cat -v <<<"$out"; exit 1; fi
printf '%s\n' "$out" > "$printed"
/usr/bin/python3 - "$jsonl" "$printed" <<'EOF' || exit 1
import json, re, sys
printed = {}
for m in re.finditer(r"^\[(prompt\d+) #(\d+)\] v(\d+) (\d+) tokens, mean logprob (-?[\d.]+), (\w+),", open(sys.argv[2]).read(), re.M):
    printed[(m[1], int(m[2]))] = (int(m[3]), int(m[4]), float(m[5]), m[6])
lines = [json.loads(l) for l in open(sys.argv[1])]
assert len(lines) == 16 == len(printed), (len(lines), len(printed))
for s in lines:
    assert len(s["logprobs"]) == len(s["output_ids"]) == printed[(s["request_id"], s["sample_index"])][1], s
    assert all(x <= 0 for x in s["logprobs"]), s
    mean = sum(s["logprobs"]) / len(s["logprobs"]) if s["logprobs"] else 0.0
    version, _, printed_mean, reason = printed[(s["request_id"], s["sample_index"])]
    assert abs(mean - printed_mean) <= 6e-4 and version == s["policy_version"] and reason == s["finish_reason"], s
    assert s["prompt_ids"][0] == 1 and s["num_prompt_tokens"] == len(s["prompt_ids"]), s
    assert s["version_spans"] == ([{"begin": 0, "end": len(s["output_ids"]), "version": 0}] if s["output_ids"] else []), s
EOF
if VROLL_LOG_LEVEL=warn "$BIN" --n 1 --max-new-tokens 2 >/dev/full 2>"$err"; then echo ">/dev/full: exit 0"; exit 1; fi
grep -q "writing the output to stdout failed" "$err" || { echo ">/dev/full: no error said:"; cat "$err"; exit 1; }
# The same for the --jsonl file (helper-80: the engine swallowed the callback's exception, exit 0).
if VROLL_LOG_LEVEL=warn "$BIN" --n 2 --max-new-tokens 2 --jsonl /dev/full >/dev/null 2>"$err"; then
  echo "--jsonl /dev/full: exit 0"; exit 1
fi
grep -q -- "--jsonl /dev/full: writing failed" "$err" || { echo "--jsonl /dev/full:"; cat "$err"; exit 1; }
# Ctrl-C: the samples finished so far are kept, the others end aborted with their tokens so far
# (every sample printed and in the --jsonl file once), exit 130.
prompts=(); for i in $(seq 8); do prompts+=(--prompt "p$i"); done
: > "$jsonl"  # its first line then says the handler is installed (the signal is sent after it)
VROLL_LOG_LEVEL=warn "$BIN" "${prompts[@]}" --n 256 --max-new-tokens 240 --jsonl "$jsonl" >/dev/null 2>"$err" &
pid=$!
for _ in $(seq 600); do [ -s "$jsonl" ] && break; sleep 0.05; done
kill -INT "$pid"
wait "$pid"; rc=$?
finished=$(sed -n 's/.*interrupted: \([0-9]*\) of 2048 samples.*/\1/p' "$err")
aborted=$(grep -c '"finish_reason":"aborted"' "$jsonl")
[ "$rc" -eq 130 ] && [ -n "$finished" ] && [ "$(wc -l < "$jsonl")" -eq 2048 ] && [ "$finished" -lt 2048 ] &&
  [ "$aborted" -eq $((2048 - finished)) ] ||
  { echo "SIGINT: exit $rc, $(wc -l < "$jsonl") lines written ($aborted aborted), stderr:"; cat "$err"; exit 1; }
echo "ok: blocks float32 ${num_blocks[float32]}, float16 ${num_blocks[float16]}, bfloat16 ${num_blocks[bfloat16]}"
