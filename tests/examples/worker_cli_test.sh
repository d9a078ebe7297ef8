#!/usr/bin/env bash
# vroll-keygen and vroll-worker's command line: the mistakes an operator makes with key files,
# seeds and threads are refused or warned about, naming what is wrong, and secret key files are
# private. Usage: worker_cli_test.sh WORKER KEYGEN
set -u
export VROLL_LOG_LEVEL=info  # its warnings are checked
WORKER="$1"
KEYGEN="$2"
. "$(dirname "$0")/test_lib.sh"  # dir, worker_pid, fail
# expect_refused NAME MESSAGE ARGS...: the worker exits non-zero and says MESSAGE (a fixed string).
expect_refused() {
  local name="$1" message="$2"
  shift 2
  # A regression would start a worker that serves: 60 s bounds it (exit 124: "accepted" too).
  local rc=0
  timeout 60 "$WORKER" --endpoint "ipc://$dir/$name.sock" "$@" >"$dir/$name.out" 2>"$dir/$name.err" || rc=$?
  [ "$rc" -ne 0 ] || fail "$name: accepted: $*"
  [ "$rc" -ne 124 ] || fail "$name: still running after 60 s: $*"
  grep -qF -- "$message" "$dir/$name.err" || fail "$name: no '$message' in its output"
}

# Keys: an empty name is refused; a secret key file is mode 0600, also when --force overwrites
# one that was world-readable.
"$KEYGEN" "" >/dev/null 2>"$dir/keygen_empty.err" && fail "vroll-keygen '' accepted"
grep -q "names no file" "$dir/keygen_empty.err" || fail "vroll-keygen '': no 'names no file'"
"$KEYGEN" "$dir/." >/dev/null 2>"$dir/keygen_dot.err" && fail "vroll-keygen DIR/. accepted"
grep -q "names no file" "$dir/keygen_dot.err" || fail "vroll-keygen DIR/.: no 'names no file'"
"$KEYGEN" "$dir/a" >/dev/null 2>&1 || fail "vroll-keygen a"
"$KEYGEN" "$dir/b" >/dev/null 2>&1 || fail "vroll-keygen b"
[ "$(stat -c %a "$dir/a.key")" = 600 ] || fail "a.key has mode $(stat -c %a "$dir/a.key")"
chmod 644 "$dir/a.key"
"$KEYGEN" --force "$dir/a" >/dev/null 2>&1 || fail "vroll-keygen --force a"
[ "$(stat -c %a "$dir/a.key")" = 600 ] || fail "a.key has mode $(stat -c %a "$dir/a.key") after --force"

# Key file mix-ups that would otherwise only show as clients timing out.
expect_refused public_as_secret "a .pub file holds a public key" \
  --curve-secret-key "$dir/a.pub" --curve-trainer-keys "$dir/b.pub"
cp "$dir/a.key" "$dir/c.key"
cp "$dir/b.pub" "$dir/c.pub"
expect_refused mismatched_pair "beside it holds another pair's public key" \
  --curve-secret-key "$dir/c.key" --curve-trainer-keys "$dir/b.pub"
expect_refused secret_as_allow_list "a .key file holds a secret key" \
  --curve-secret-key "$dir/a.key" --curve-trainer-keys "$dir/b.key"

# A bad endpoint is refused before the model is loaded (here an empty file, which would fail to load).
: >"$dir/empty_model.bin"
rc=0
timeout 60 "$WORKER" --endpoint tcp://127.0.0.1:99999 --model "$dir/empty_model.bin" \
  >"$dir/bad_port.out" 2>"$dir/bad_port.err" || rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "bad_port: exit code $rc"
grep -qF "endpoint tcp://127.0.0.1:99999: the port must be a number in [0, 65535]" "$dir/bad_port.err" ||
  fail "bad_port: the endpoint is not named (after the model load?): $(cat "$dir/bad_port.err")"

# A port in use is reported before the model is loaded (the empty model file would fail to load).
/usr/bin/python3 -c 'import socket, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True); time.sleep(120)' >"$dir/listener.port" &
listener_pid=$!
for _ in $(seq 100); do [ -s "$dir/listener.port" ] && break; sleep 0.1; done
port=$(cat "$dir/listener.port")
[ -n "$port" ] || fail "the port-holding listener did not start"
rc=0
timeout 60 "$WORKER" --endpoint "tcp://127.0.0.1:$port" --model "$dir/empty_model.bin" \
  >"$dir/port_in_use.out" 2>"$dir/port_in_use.err" || rc=$?
kill "$listener_pid"
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "port_in_use: exit code $rc"
grep -qF "cannot bind tcp://127.0.0.1:$port: Address already in use" "$dir/port_in_use.err" ||
  fail "port_in_use: the port is not named (after the model load?): $(cat "$dir/port_in_use.err")"

# A quiet log level silences progress and warnings, not the reason for a failed exit.
for level in off critical; do
  rc=0
  VROLL_LOG_LEVEL=$level timeout 60 "$WORKER" --endpoint tcp://127.0.0.1:99999 --model "$dir/empty_model.bin" \
    >"$dir/bad_port_$level.out" 2>"$dir/bad_port_$level.err" || rc=$?
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "bad_port at log level $level: exit code $rc"
  grep "^vroll-worker: error: " "$dir/bad_port_$level.err" |
    grep -qF "endpoint tcp://127.0.0.1:99999: the port must be a number in [0, 65535]" || fail "bad_port at log level $level: no reason given: $(cat "$dir/bad_port_$level.err")"
done

# MiB sizes whose bytes would overflow int64 are refused, not wrapped (helper-62: 2^44 + 1 MiB
# became a 1 MiB KV cache; 9999999999999 a negative size).
expect_refused kv_mb_wraps "--kv-cache-mb: must be an integer in [1, 8796093022207] (got '17592186044417')" \
  --kv-cache-mb 17592186044417
expect_refused message_mb_overflows "--max-message-mb: must be an integer in [1, 8796093022207] (got '99999999999999')" \
  --max-message-mb 99999999999999

# Seeds outside [0, 2^64) are refused, not wrapped or saturated.
expect_refused seed_negative "must be an integer in [0, 2^64) (got '-1')" --seed -1
expect_refused seed_too_big "must be an integer in [0, 2^64) (got '18446744073709551616')" \
  --seed 18446744073709551616

# More threads than cores: a warning (here before the refusal of a mix-up, to keep it short).
# (The cores this process may use: GNU nproc would also follow OMP_NUM_THREADS, which CI may set.)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
threads=$(( cores + 1 ))
expect_refused too_many_threads "$threads threads on $cores cores" --threads "$threads" \
  --curve-secret-key "$dir/a.pub" --curve-trainer-keys "$dir/b.pub"

# Far more threads than cores (a run that looks hung: helper-62) are refused, naming the limit.
expect_refused way_too_many_threads "$(( cores * 8 + 1 )) threads (--threads) on $cores cores this process may use: at most $(( cores * 8 ))" \
  --threads "$(( cores * 8 + 1 ))"

# A key on both allow-lists starts, with a warning that it gets trainer rights; a secret key file
# others may read is warned about too.
chmod 640 "$dir/a.key"
"$WORKER" --endpoint "ipc://$dir/both.sock" --curve-secret-key "$dir/a.key" \
  --curve-trainer-keys "$dir/b.pub" --curve-client-keys "$dir/b.pub" --max-queued-replies 1234 \
  --max-pending-per-client 7 --block-size 8 >"$dir/both.out" 2>"$dir/both.err" &
worker_pid=$!
for _ in $(seq 600); do
  grep -q "ipc://$dir/both.sock" "$dir/both.out" 2>/dev/null && break
  kill -0 "$worker_pid" 2>/dev/null || fail "the worker with a key on both lists exited"
  sleep 0.1
done
grep -q "is on both the trainer and the client allow-list" "$dir/both.err" ||
  fail "no warning for a key on both allow-lists"
grep -qF "$dir/a.key: this secret key file is open to group or others (mode 0640): chmod 600 it" "$dir/both.err" ||
  fail "no warning for a secret key file others may read"
# The queue options reach the worker's config (its one config line).
grep -q "send_high_water_mark 1234, max_pending_per_client 7," "$dir/both.err" ||
  fail "--max-queued-replies / --max-pending-per-client not in the worker's config"
grep -q " blocks x 8 tokens = " "$dir/both.err" || fail "--block-size 8 did not reach the engine's KV cache"
kill "$worker_pid"
wait "$worker_pid" || fail "the worker did not exit cleanly on SIGTERM"
worker_pid=""
# SIGINT during start-up stops the worker at once (helper-67: started in the background of a
# script, as here, it inherits SIGINT ignored; one sent before it served was lost, and it then
# served anyway).
# Sent once main() runs (its BLAS line is logged), while a 1 GiB KV cache is being set up (a signal
# that arrives while the dynamic loader maps LibTorch, before main(), stays ignored).
"$WORKER" --endpoint "ipc://$dir/int.sock" --kv-cache-mb 1024 >"$dir/int.out" 2>"$dir/int.err" &
int_pid=$!
for _ in $(seq 2000); do grep -q "BLAS: " "$dir/int.err" 2>/dev/null && break; sleep 0.01; done
kill -INT "$int_pid"
for _ in $(seq 200); do kill -0 "$int_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$int_pid" 2>/dev/null; then
  kill -KILL "$int_pid"
  fail "SIGINT during start-up: the worker still runs 20 s later"
fi
rc=0
wait "$int_pid" || rc=$?
[ "$rc" -eq 130 ] || fail "SIGINT during start-up: exit code $rc, want 130"
grep -q "stopped by a signal during start-up" "$dir/int.err" || fail "SIGINT during start-up: no word of it"
# The KV block version check is on in the worker unless --no-check-block-versions (the engine's
# config line says which).
for flag in "" --no-check-block-versions; do
  want=on; [ -n "$flag" ] && want=off
  "$WORKER" --endpoint "ipc://$dir/check$want.sock" --kv-cache-mb 8 $flag >/dev/null 2>"$dir/check$want.err" &
  pid=$!
  for _ in $(seq 300); do grep -q "KV block version check" "$dir/check$want.err" && break; sleep 0.1; done
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  grep -q "KV block version check $want" "$dir/check$want.err" ||
    fail "${flag:-default}: no 'KV block version check $want': $(grep engine: "$dir/check$want.err")"
done
echo "PASS"
