# Sourced by the example tests: a scratch directory `dir` (short, under /tmp: ipc:// paths are
# limited to 107 bytes), removed on exit with the worker `worker_pid` if one still runs, and
# fail MESSAGE, which prints the tails of the outputs kept in `dir` and exits 1.
dir=$(mktemp -d /tmp/vroll-test.XXXXXX)
worker_pid=""
cleanup() {
  if [ -n "$worker_pid" ]; then kill "$worker_pid" 2>/dev/null; wait "$worker_pid" 2>/dev/null; fi
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$dir"/*.out "$dir"/*.err; do [ -f "$f" ] && { echo "--- $f"; tail -40 "$f"; }; done
  exit 1
}
