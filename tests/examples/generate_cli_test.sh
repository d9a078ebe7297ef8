#!/usr/bin/env bash
# vroll-generate end to end: greedy stories260K from BOS for 200 tokens prints the reference C
# implementation's text byte for byte (stdout only; logs go to stderr), and the embedded default
# runs without any file; so does a Hugging Face conversion of it. Exit 77 = skipped (no ../shared).
set -u
BIN="$1"
SHARED="$2"
CONVERT="${3:-}"  # vroll-convert-hf, optional
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# The embedded default needs no files and prints something.
"$BIN" --max-new-tokens 20 --seed 1 >"$out" 2>/dev/null || { echo "default model run failed"; exit 1; }
[ -s "$out" ] || { echo "default model printed nothing"; exit 1; }
# Bad input: a named error and a non-zero exit, nothing on stdout.
if "$BIN" --model "$BIN" --tokenizer "$BIN" >"$out" 2>/tmp/vroll_cli_err.$$; then echo "corrupt model accepted"; exit 1; fi
grep -q "$BIN" /tmp/vroll_cli_err.$$ || { echo "error does not name the file:"; cat /tmp/vroll_cli_err.$$; exit 1; }
# A device this LibTorch lacks: one line naming --device, no LibTorch backtrace.
if "$BIN" --device cuda --max-new-tokens 2 >"$out" 2>/tmp/vroll_cli_err.$$; then echo "--device cuda accepted on a CPU build"; exit 1; fi
grep -q -- "--device cuda: " /tmp/vroll_cli_err.$$ || { echo "error does not name --device:"; cat /tmp/vroll_cli_err.$$; exit 1; }
# Also when the log is off (helper-62: stderr was empty at VROLL_LOG_LEVEL=off).
if VROLL_LOG_LEVEL=off "$BIN" --device cuda --max-new-tokens 2 >"$out" 2>/tmp/vroll_cli_err.$$; then echo "--device cuda accepted"; exit 1; fi
grep -q -- "^vroll-generate: error: --device cuda: " /tmp/vroll_cli_err.$$ ||
  { echo "no reason at VROLL_LOG_LEVEL=off:"; cat /tmp/vroll_cli_err.$$; exit 1; }
if grep -q "frame #" /tmp/vroll_cli_err.$$; then echo "error carries a backtrace:"; cat /tmp/vroll_cli_err.$$; exit 1; fi
# Integer options name what they expect.
"$BIN" --max-new-tokens 0 >"$out" 2>/tmp/vroll_cli_err.$$ && { echo "--max-new-tokens 0 accepted"; exit 1; }
grep -q -- "--max-new-tokens: must be an integer >= 1 (got '0')" /tmp/vroll_cli_err.$$ || { cat /tmp/vroll_cli_err.$$; exit 1; }
"$BIN" --threads -1 >"$out" 2>/tmp/vroll_cli_err.$$ && { echo "--threads -1 accepted"; exit 1; }
grep -q -- "--threads: must be an integer >= 0 (got '-1')" /tmp/vroll_cli_err.$$ || { cat /tmp/vroll_cli_err.$$; exit 1; }
"$BIN" --temperature -1 >"$out" 2>/tmp/vroll_cli_err.$$ && { echo "--temperature -1 accepted"; exit 1; }
grep -q -- "--temperature: must be a number >= 0 (got '-1')" /tmp/vroll_cli_err.$$ || { cat /tmp/vroll_cli_err.$$; exit 1; }
# An unknown or upper-case VROLL_LOG_LEVEL does not silence errors (spdlog would map it to off).
VROLL_LOG_LEVEL=WARN "$BIN" --top-p 0 >"$out" 2>/tmp/vroll_cli_err.$$ && { echo "--top-p 0 accepted"; exit 1; }
grep -q "top_p = 0 must be in (0, 1]" /tmp/vroll_cli_err.$$ || { echo "VROLL_LOG_LEVEL=WARN hid the error"; cat /tmp/vroll_cli_err.$$; exit 1; }
VROLL_LOG_LEVEL=chatty "$BIN" --top-p 0 >"$out" 2>/tmp/vroll_cli_err.$$ && { echo "--top-p 0 accepted"; exit 1; }
grep -q "VROLL_LOG_LEVEL=chatty is not a log level" /tmp/vroll_cli_err.$$ || { echo "no word on VROLL_LOG_LEVEL=chatty"; cat /tmp/vroll_cli_err.$$; exit 1; }
grep -q "top_p = 0 must be in (0, 1]" /tmp/vroll_cli_err.$$ || { echo "VROLL_LOG_LEVEL=chatty hid the error"; cat /tmp/vroll_cli_err.$$; exit 1; }
rm -f /tmp/vroll_cli_err.$$
if [ ! -f "$SHARED/models/stories260K.bin" ]; then echo "skipped: no $SHARED/models"; exit 77; fi
"$BIN" --model "$SHARED/models/stories260K.bin" --tokenizer "$SHARED/models/tok512.bin" \
  --temperature 0 --max-new-tokens 200 >"$out" 2>/dev/null || { echo "generation failed"; exit 1; }
if ! cmp "$out" "$SHARED/reference/stories260K_greedy_n200.txt"; then
  echo "output differs from the reference:"; diff "$out" "$SHARED/reference/stories260K_greedy_n200.txt"; exit 1
fi
# With a prompt the text is printed from the prompt on, as run.c prints it: greedy from the
# reference's own first words continues as the reference does, so prompt + continuation is a
# prefix of it.
"$BIN" --model "$SHARED/models/stories260K.bin" --tokenizer "$SHARED/models/tok512.bin" \
  --prompt "Once upon a time, there was a little girl" --temperature 0 --max-new-tokens 30 >"$out" 2>/dev/null ||
  { echo "generation with a prompt failed"; exit 1; }
n=$(($(wc -c <"$out") - 1))  # without the final newline
if [ "$n" -lt 100 ] || ! head -c "$n" "$SHARED/reference/stories260K_greedy_n200.txt" | cmp -s - <(head -c "$n" "$out"); then
  echo "with --prompt, the output is not the prompt followed by the reference's continuation:"; cat "$out"; exit 1
fi
# A tokenizer with bytes past the model's vocabulary (here tok512 twice) loads, with a warning.
cat "$SHARED/models/tok512.bin" "$SHARED/models/tok512.bin" >"$out.tok"
"$BIN" --model "$SHARED/models/stories260K.bin" --tokenizer "$out.tok" --max-new-tokens 2 >/dev/null 2>"$out.err" ||
  { echo "a tokenizer with trailing bytes was refused:"; cat "$out.err"; rm -f "$out.tok" "$out.err"; exit 1; }
grep -q "6227 bytes follow the model's 512 entries and are ignored" "$out.err" ||
  { echo "no warning about the tokenizer's trailing bytes:"; cat "$out.err"; rm -f "$out.tok" "$out.err"; exit 1; }
rm -f "$out.tok" "$out.err"
# A Hugging Face directory (vroll-convert-hf, float32: exact) gives the same text; a file of it is
# refused naming the directory; every --dtype spelling of float16 writes the same file.
if [ -n "$CONVERT" ]; then
  hf=$(mktemp -d)
  "$CONVERT" --input "$SHARED/models/stories260K.bin" --output "$hf/f32" --dtype fp32 2>/dev/null ||
    { echo "vroll-convert-hf failed"; rm -rf "$hf"; exit 1; }
  "$BIN" --model "$hf/f32" --tokenizer "$SHARED/models/tok512.bin" --temperature 0 --max-new-tokens 200 \
    >"$out" 2>"$hf/err" || { echo "generation from the HF directory failed:"; cat "$hf/err"; rm -rf "$hf"; exit 1; }
  cmp -s "$out" "$SHARED/reference/stories260K_greedy_n200.txt" ||
    { echo "the HF directory's text differs from the reference:"; cat "$out"; rm -rf "$hf"; exit 1; }
  if "$BIN" --model "$hf/f32/model.safetensors" --tokenizer "$SHARED/models/tok512.bin" >"$out" 2>"$hf/err"; then
    echo "a safetensors file was accepted as --model"; rm -rf "$hf"; exit 1
  fi
  grep -qF "pass its directory $hf/f32" "$hf/err" || { echo "no word on the directory:"; cat "$hf/err"; rm -rf "$hf"; exit 1; }
  # The converter given such a file says what it is (helper-70: read as llama2.c, "hidden_dim = 0").
  if "$CONVERT" --input "$hf/f32/model.safetensors" --output "$hf/again" >"$out" 2>"$hf/err"; then
    echo "vroll-convert-hf accepted a safetensors file as --input"; rm -rf "$hf"; exit 1
  fi
  grep -qF "this is a file of a Hugging Face checkpoint; vroll-convert-hf converts llama2.c" "$hf/err" ||
    { echo "vroll-convert-hf does not say its --input is a Hugging Face file:"; cat "$hf/err"; rm -rf "$hf"; exit 1; }
  for dtype in float16 fp16 f16 half; do
    "$CONVERT" --input "$SHARED/models/stories260K.bin" --output "$hf/$dtype" --dtype "$dtype" 2>/dev/null ||
      { echo "vroll-convert-hf --dtype $dtype failed"; rm -rf "$hf"; exit 1; }
    cmp -s "$hf/float16/model.safetensors" "$hf/$dtype/model.safetensors" ||
      { echo "--dtype $dtype wrote another file than --dtype float16"; rm -rf "$hf"; exit 1; }
  done
  # Any positive --shard-mb shards, even one below half a byte (helper-65: it rounded to 0, one file).
  "$CONVERT" --input "$SHARED/models/stories260K.bin" --output "$hf/tiny" --shard-mb 1e-9 2>/dev/null ||
    { echo "vroll-convert-hf --shard-mb 1e-9 failed"; rm -rf "$hf"; exit 1; }
  [ -f "$hf/tiny/model.safetensors.index.json" ] && [ ! -f "$hf/tiny/model.safetensors" ] ||
    { echo "--shard-mb 1e-9 wrote one file:"; ls "$hf/tiny"; rm -rf "$hf"; exit 1; }
  rm -rf "$hf"
fi
# Output lost (>/dev/full) is an error, not exit 0; a device this build cannot run is named in one
# line, not LibTorch's dispatcher text (helper-76).
gen_err=$(mktemp)
if VROLL_LOG_LEVEL=warn "$BIN" --max-new-tokens 5 >/dev/full 2>"$gen_err"; then echo ">/dev/full: exit 0"; rm -f "$gen_err"; exit 1; fi
grep -q "writing the output to stdout failed" "$gen_err" || { echo ">/dev/full:"; cat "$gen_err"; rm -f "$gen_err"; exit 1; }
for device in mps meta vulkan; do
  VROLL_LOG_LEVEL=warn "$BIN" --device "$device" --max-new-tokens 2 >/dev/null 2>"$gen_err"; rc=$?
  [ "$rc" -eq 2 ] && [ "$(wc -l < "$gen_err")" -eq 1 ] && grep -q -- "--device $device: not supported" "$gen_err" ||
    { echo "--device $device: exit $rc, stderr:"; cat "$gen_err"; rm -f "$gen_err"; exit 1; }
done
rm -f "$gen_err"
echo "vroll-generate matches the reference byte for byte"
