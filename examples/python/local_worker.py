"""Starting vroll-worker processes on this machine (the examples and the end-to-end tests).

A worker given `--endpoint tcp://127.0.0.1:*` binds a port the kernel picks and prints the bound
endpoint as its one line on stdout. Reading that line is race-free; picking a free port first and
passing it on is not: another process (any outgoing connection takes an ephemeral port) can take
the port in between, and the worker then exits with "cannot bind". CI saw that happen.
"""
import os
import select
import subprocess
import time


class WorkerStartError(RuntimeError):
    """The worker exited or printed no endpoint in time; the message carries its log's tail."""


def _tail(path, limit=4000):
    if path == os.devnull:
        return "(discarded: pass log_path= to keep the worker's log)"
    try:
        with open(path, errors="replace") as f:
            return f.read()[-limit:]
    except OSError as e:
        return f"(no log: {e})"


def start_worker(worker_bin, args=(), log_path=os.devnull, endpoint="tcp://127.0.0.1:*", timeout_s=60.0):
    """Starts `worker_bin --endpoint ENDPOINT ARGS...` with its stderr (the log) appended to
    `log_path`, and waits until it reports the endpoint it bound.

    Returns (subprocess.Popen, bound endpoint, e.g. "tcp://127.0.0.1:43127").
    Raises WorkerStartError, naming the command and the log's tail, when the worker exits first
    (bad flag, cannot bind, cannot load the model) or prints nothing within `timeout_s` seconds;
    the process is killed in the second case.
    """
    cmd = [worker_bin, "--endpoint", endpoint, *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
    deadline = time.monotonic() + timeout_s
    line = b""
    try:
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerStartError(f"{' '.join(cmd)}: no endpoint on stdout after {timeout_s:g} s; "
                                       f"log {log_path}:\n{_tail(log_path)}")
            ready, _, _ = select.select([proc.stdout], [], [], min(remaining, 0.5))
            if ready:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:  # EOF: the worker exited
                    proc.wait(10)
                    raise WorkerStartError(f"{' '.join(cmd)}: exited with status {proc.returncode} before "
                                           f"reporting its endpoint; log {log_path}:\n{_tail(log_path)}")
                line += chunk
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        raise
    proc.stdout.close()  # the worker prints nothing else on stdout
    return proc, line.decode().strip()


def stop_worker(proc, timeout_s=10.0):
    """SIGTERM (the worker finishes its step and exits), then SIGKILL after `timeout_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
