#!/usr/bin/env bash
# vroll-trainer-example end to end: a vroll-worker on a unique ipc:// endpoint, the example pushes
# versions 1 and 2 and requests rollouts under each; it must exit 0, print samples of both
# versions, and leave the worker to exit cleanly (--shutdown-worker). With ../shared present,
# weights of another shape are refused, and the whole run is repeated on stories260K with its
# tokenizer. With KEYGEN, a run over CURVE: the example's key options, the halves of a key pair
# swapped refused at once, and a trainer key not on the worker's list refused (a timeout).
# Usage: trainer_example_test.sh WORKER EXAMPLE [SHARED [KEYGEN]]
set -u
WORKER="$1"
EXAMPLE="$2"
SHARED="${3:-}"
KEYGEN="${4:-}"
. "$(dirname "$0")/test_lib.sh"  # dir, worker_pid, fail

# A KV cache that cannot be allocated (10 TB): one line naming its size and --kv-cache-mb, no
# backtrace.
if "$WORKER" --endpoint "ipc://$dir/huge.sock" --kv-cache-mb 10000000 >"$dir/huge.out" 2>"$dir/huge.err"; then
  fail "--kv-cache-mb 10000000 accepted"
fi
grep -q "cannot allocate .* MiB of float32 keys and values .*vroll-worker --kv-cache-mb" "$dir/huge.err" ||
  fail "the allocation failure does not name the KV cache and --kv-cache-mb"
if grep -q "frame #" "$dir/huge.err"; then fail "the allocation failure carries a backtrace"; fi
# Beyond 2^30 blocks: refused before allocating, naming the size asked for.
if "$WORKER" --endpoint "ipc://$dir/huger.sock" --kv-cache-mb 100000000 >"$dir/huger.out" 2>"$dir/huger.err"; then
  fail "--kv-cache-mb 100000000 accepted"
fi
grep -q "(100000000 MiB) holds .* at most 2^30 blocks" "$dir/huger.err" ||
  fail "a KV cache beyond 2^30 blocks is not refused naming the size asked for"

# A KV cache dtype it does not know is refused by name.
if "$WORKER" --endpoint "ipc://$dir/dtype.sock" --kv-cache-dtype float8 >"$dir/dtype.out" 2>"$dir/dtype.err"; then
  fail "--kv-cache-dtype float8 accepted"
fi
grep -q -- "--kv-cache-dtype" "$dir/dtype.out" "$dir/dtype.err" || fail "the bad --kv-cache-dtype is not named"

# run_case NAME [model args...]: one worker, one example run against it; the worker also gets
# the arguments in the array worker_extra, the example those in example_extra.
worker_extra=()
example_extra=()
run_case() {
  local name="$1"; shift
  local endpoint="ipc://$dir/$name.sock"
  "$WORKER" --endpoint "$endpoint" --kv-cache-mb 16 --threads 1 "$@" ${worker_extra[@]+"${worker_extra[@]}"} \
    >"$dir/$name-worker.out" 2>"$dir/$name-worker.err" &
  worker_pid=$!
  # The worker prints its endpoint once bound (the client would also wait, but this catches a
  # worker that fails to start). At most 60 s.
  for _ in $(seq 600); do
    [ -s "$dir/$name-worker.out" ] && break
    kill -0 "$worker_pid" 2>/dev/null || fail "$name: vroll-worker exited before binding"
    sleep 0.1
  done
  [ -s "$dir/$name-worker.out" ] || fail "$name: vroll-worker did not bind $endpoint within 60 s"
  if [ "$name" = default ] && [ -f "$SHARED/models/stories260K.bin" ]; then
    # Weights of another shape: refused before anything is pushed, naming both shapes.
    if "$EXAMPLE" --endpoint "$endpoint" --model "$SHARED/models/stories260K.bin" \
      >"$dir/mismatch-example.out" 2>"$dir/mismatch-example.err"; then
      fail "weights of another shape were accepted"
    fi
    grep -q "does not have the shape of" "$dir/mismatch-example.err" || fail "the shape mismatch is not named"
  fi
  if [ "$name" = default ]; then
    # Bad --prompt-ids: refused naming the item, before anything is pushed (no wrapped ids).
    # list|item|message
    for case in "1,abc|abc|is not an integer" "1,,2||is not an integer" "1,2x|2x|is not an integer" \
      "1,4294967297|4294967297|is out of range for a token id" \
      "1,99999999999999999999|99999999999999999999|is out of range for a token id"; do
      IFS='|' read -r bad item message <<<"$case"
      if "$EXAMPLE" --endpoint "$endpoint" --prompt-ids "$bad" >"$dir/ids-example.out" 2>"$dir/ids-example.err"; then
        fail "--prompt-ids $bad accepted"
      fi
      grep -qF -- "--prompt-ids '$bad': '$item' $message" "$dir/ids-example.out" "$dir/ids-example.err" ||
        fail "--prompt-ids $bad: no \"'$item' $message\""
    done
    # Bad sampling and noise options: refused before the first push (the run below then still
    # pushes version 1; helper-62 saw version 2 pushed, then the rollout refused).
    # option|value|message
    for case in "--temperature|-1|temperature" "--perturb-std|nan|--perturb-std" \
      "--perturb-std|-1|--perturb-std" \
      "--n|100000|--n 100000: the worker takes at most 256 samples per request"; do
      IFS='|' read -r option value message <<<"$case"
      if "$EXAMPLE" --endpoint "$endpoint" "$option" "$value" >"$dir/opt-example.out" 2>"$dir/opt-example.err"; then
        fail "$option $value accepted"
      fi
      grep -qF -- "$message" "$dir/opt-example.out" "$dir/opt-example.err" || fail "$option $value: no '$message'"
      grep -q "pushed version" "$dir/opt-example.out" && fail "$option $value: weights pushed before the refusal"
    done
  fi
  if [ "$name" = curve ]; then
    # A trainer key that is not on the worker's list: CURVE refuses the handshake silently, so the
    # example gives up after its timeout, having pushed nothing.
    if "$EXAMPLE" --endpoint "$endpoint" --timeout-ms 2000 --curve-server-key "$dir/w.pub" \
      --curve-secret-key "$dir/other.key" >"$dir/unknown-example.out" 2>"$dir/unknown-example.err"; then
      fail "a trainer key not on the worker's list was accepted"
    fi
    grep -q "pushed version" "$dir/unknown-example.out" && fail "a trainer key not on the list pushed weights"
    grep -q "no reply" "$dir/unknown-example.err" || fail "a trainer key not on the list: no timeout ('no reply')"
  fi
  "$EXAMPLE" --endpoint "$endpoint" --n 3 --max-new-tokens 12 --timeout-ms 60000 --shutdown-worker "$@" \
    ${example_extra[@]+"${example_extra[@]}"} \
    >"$dir/$name-example.out" 2>"$dir/$name-example.err"
  local rc=$?
  [ "$rc" -eq 0 ] || fail "$name: vroll-trainer-example exited with $rc"
  wait "$worker_pid"; local worker_rc=$?
  worker_pid=""
  [ "$worker_rc" -eq 0 ] || fail "$name: vroll-worker exited with $worker_rc after --shutdown-worker"
  local out="$dir/$name-example.out"
  grep -q "^pushed version 1: applied" "$out" || fail "$name: no 'pushed version 1' line"
  grep -q "^pushed version 2: applied" "$out" || fail "$name: no 'pushed version 2' line"
  local v1 v2
  v1=$(grep -c "^\[v1-prompt[0-9]* #[0-9]*\] policy_version 1," "$out")
  v2=$(grep -c "^\[v2-prompt[0-9]* #[0-9]*\] policy_version 2," "$out")
  [ "$v1" -eq 6 ] || fail "$name: $v1 samples of version 1, expected 6 (2 prompts x 3)"
  [ "$v2" -eq 6 ] || fail "$name: $v2 samples of version 2, expected 6 (2 prompts x 3)"
  grep -q "MISMATCH" "$out" && fail "$name: a sample carries another version"
  grep -q "^ok: 12 samples" "$out" || fail "$name: no final 'ok' line"
  echo "$name: 6 samples under version 1 and 6 under version 2, worker exited cleanly"
}

run_case default

# Weights perturbed into non-finite logits (helper-69): the second version's samples all end in
# an error. Their tags are right, but the example must not say "ok": it exits non-zero naming
# the first errored sample and the worker's message, and prints each sample's error.
"$WORKER" --endpoint "ipc://$dir/errors.sock" --kv-cache-mb 16 --threads 1 >"$dir/errors-worker.out" \
  2>"$dir/errors-worker.err" &
worker_pid=$!
if "$EXAMPLE" --endpoint "ipc://$dir/errors.sock" --n 1 --max-new-tokens 4 --perturb-std 1e30 --shutdown-worker \
  >"$dir/errors-example.out" 2>"$dir/errors-example.err"; then
  fail "samples that ended in an error were reported as a success"
fi
wait "$worker_pid" || fail "errors: vroll-worker exited with $? after --shutdown-worker"
worker_pid=""
grep -q "^ok:" "$dir/errors-example.out" && fail "errors: an 'ok' line although samples ended in an error"
grep -q "2 of 4 samples ended with an error; the first: v2-prompt0 #0: .*finite" "$dir/errors-example.err" ||
  fail "errors: the failure does not count the errored samples and give the first one's message"
[ "$(grep -c "^  error: .*finite" "$dir/errors-example.out")" -eq 2 ] || fail "errors: the samples' errors are not printed"
echo "errors: 2 of 4 samples ended in an error (non-finite logits); reported, exit non-zero"

# --shutdown-worker holds when the example fails after connecting (helper-76: only a successful
# run asked the worker to exit): a worker serving stories260K, the example holding the default model.
if [ -n "$SHARED" ] && [ -f "$SHARED/models/stories260K.bin" ]; then
  "$WORKER" --endpoint "ipc://$dir/other.sock" --model "$SHARED/models/stories260K.bin" --kv-cache-mb 16 --threads 1 \
    >"$dir/other-worker.out" 2>"$dir/other-worker.err" &
  worker_pid=$!
  if "$EXAMPLE" --endpoint "ipc://$dir/other.sock" --n 1 --max-new-tokens 4 --shutdown-worker \
    >"$dir/other-example.out" 2>"$dir/other-example.err"; then
    fail "other model: the example succeeded against a worker with another model"
  fi
  grep -q "does not have the shape" "$dir/other-example.err" || fail "other model: $(cat "$dir/other-example.err")"
  for _ in $(seq 100); do kill -0 "$worker_pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$worker_pid" 2>/dev/null && fail "other model: the worker still runs after --shutdown-worker"
  wait "$worker_pid" || fail "other model: vroll-worker exited with $? after --shutdown-worker"
  worker_pid=""
  echo "other model: refused, and the worker exited (--shutdown-worker)"
fi

if [ -n "$SHARED" ] && [ -f "$SHARED/models/stories260K.bin" ] && [ -f "$SHARED/models/tok512.bin" ]; then
  run_case stories260K --model "$SHARED/models/stories260K.bin" --tokenizer "$SHARED/models/tok512.bin"
else
  echo "stories260K case skipped: no ${SHARED:-<shared>}/models"
fi
if [ -n "$KEYGEN" ]; then
  for key in w t other; do "$KEYGEN" "$dir/$key" >/dev/null 2>&1 || fail "vroll-keygen $key"; done
  # expect_example_refused NAME MESSAGE ARGS...: exits non-zero at once, saying MESSAGE.
  expect_example_refused() {
    local name="$1" message="$2"
    shift 2
    if timeout 10 "$EXAMPLE" --endpoint "ipc://$dir/none.sock" --timeout-ms 2000 "$@" \
      >"$dir/$name.out" 2>"$dir/$name.err"; then
      fail "$name: accepted: $*"
    fi
    grep -qF -- "$message" "$dir/$name.out" "$dir/$name.err" || fail "$name: no '$message'"
  }
  expect_example_refused server_key_is_secret "a .key file is a secret key" \
    --curve-server-key "$dir/w.key" --curve-secret-key "$dir/t.key"
  expect_example_refused secret_key_is_public "a .pub file holds a public key" \
    --curve-server-key "$dir/w.pub" --curve-secret-key "$dir/t.pub"
  expect_example_refused server_key_alone "--curve-server-key and --curve-secret-key go together" \
    --curve-server-key "$dir/w.pub"
  worker_extra=(--curve-secret-key "$dir/w.key" --curve-trainer-keys "$dir/t.pub")
  example_extra=(--curve-server-key "$dir/w.pub" --curve-secret-key "$dir/t.key")
  run_case curve
else
  echo "CURVE case skipped: no vroll-keygen given"
fi
