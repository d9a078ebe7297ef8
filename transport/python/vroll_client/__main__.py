r"""Quick checks of running workers from a shell; prints JSON.

    /usr/bin/python3 -m vroll_client --endpoint tcp://127.0.0.1:5555 health
    /usr/bin/python3 -m vroll_client --endpoint tcp://127.0.0.1:5555 stats
    /usr/bin/python3 -m vroll_client --endpoint tcp://127.0.0.1:5555 generate --prompt 1,72,101 \
        --n 4 --max-tokens 8 --temperature 0.8 --seed 7
    /usr/bin/python3 -m vroll_client keygen        # a CURVE key pair (JSON)
    /usr/bin/python3 -m vroll_client --endpoint tcp://10.0.0.5:5555 \
        --curve-server-key @worker.pub --curve-secret-key @trainer.key health

--endpoint repeats for several workers; health, stats, flush-cache, pause, resume and shutdown
also take them after the command (``health tcp://127.0.0.1:5555``), as do --endpoint, --timeout-s
and the CURVE keys (after the endpoints: ``health EP --timeout-s 1``; given both before and after
the command, after wins and --endpoint adds). Exit status: 0 ok, 1 a worker error or timeout, 2 usage,
141 stdout closed early (e.g. piped into ``head``), quietly, as a command killed by SIGPIPE.
Commands whose reply holds nothing (pause, resume, flush-cache, shutdown) print "ok" per worker.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import sys
from typing import List, Optional

from . import (SamplingParams, VrollClient, VrollError, client_keys_from_secret, curve_keypair,
               read_curve_key_file)


def _token_list(text: str) -> List[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids")


def _key_arg(value: Optional[str], secret: bool) -> Optional[str]:
    """A key given as Z85 text or as @FILE. vroll-keygen NAME writes the secret key to NAME.key
    and the public one to NAME.pub: the other half is refused (a wrong key only shows as a
    timeout, since CURVE refuses the handshake)."""
    if value and value.startswith("@"):
        path = value[1:]
        wrong = ".pub" if secret else ".key"
        if path.endswith(wrong):
            raise ValueError(f"{path}: a {wrong} file holds a {'public' if secret else 'secret'} "
                             f"key; --curve-{'secret' if secret else 'server'}-key takes "
                             f"{'this client' if secret else 'the worker'}'s "
                             f"{'secret key (NAME.key)' if secret else 'public key (NAME.pub)'}")
        return read_curve_key_file(path)
    return value


def _prog() -> str:
    """How this was started, for the usage text: the vroll-client command, or the module."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(("__main__.py", ".py")) and name != "-c" else "python3 -m vroll_client"


#: The connection options, taken before the command or after it (``health EP --timeout-s 1``).
_CONNECTION_OPTIONS = ("endpoint", "timeout_s", "curve_server_key", "curve_secret_key")


def _add_connection_options(p: argparse.ArgumentParser, suffix: str = "") -> None:
    """The connection options; with `suffix` (a command's copy) they default to unset and are
    stored under NAME + suffix, merged by _merge_connection_options."""
    unset = {"default": argparse.SUPPRESS} if suffix else {}
    p.add_argument("--endpoint", action="append", dest="endpoint" + suffix, metavar="ENDPOINT",
                   **(unset or {"default": []}),
                   help="worker endpoint (repeat for several); default tcp://127.0.0.1:5555")
    p.add_argument("--timeout-s", type=float, dest="timeout_s" + suffix, metavar="SECONDS",
                   **(unset or {"default": 30.0}),
                   help="seconds a worker may stay silent while it owes a reply (default 30)")
    p.add_argument("--curve-server-key", dest="curve_server_key" + suffix, metavar="KEY", **unset,
                   help="the worker's CURVE public key: Z85 text, or @FILE (e.g. @worker.pub)")
    p.add_argument("--curve-secret-key", dest="curve_secret_key" + suffix, metavar="KEY", **unset,
                   help="this client's CURVE secret key: Z85 text, or @FILE (e.g. @trainer.key); "
                        "its public key must be on the worker's allow-list")


def _merge_connection_options(args: argparse.Namespace) -> None:
    """Options given after the command win over (--endpoint: add to) those given before it."""
    for name in _CONNECTION_OPTIONS:
        after = getattr(args, name + "_after", None)
        if after is None:
            continue
        setattr(args, name, getattr(args, name) + after if name == "endpoint" else after)
        delattr(args, name + "_after")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_prog(), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_connection_options(p)
    connection = argparse.ArgumentParser(add_help=False)
    _add_connection_options(connection, "_after")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("health", "stats", "flush-cache", "pause", "resume", "shutdown"):
        c = sub.add_parser(name, parents=[connection], help=f"send {name.replace('-', '_')} to every worker")
        c.add_argument("endpoints", nargs="*", metavar="ENDPOINT",
                       help="worker endpoints, as --endpoint (both may be given)")
    sub.add_parser("keygen", help="print a new CURVE key pair (no worker contacted)")
    g = sub.add_parser("generate", parents=[connection], help="generate samples and print one JSON line per prompt")
    g.add_argument("--prompt", type=_token_list, action="append", required=True,
                   help="comma-separated token ids (repeat for several prompts)")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop-token-ids", type=_token_list, default=[],
                   help="token ids that end a sample (none by default: EOS is not implied)")
    g.add_argument("--exclude-stop-token", action="store_true",
                   help="leave the stop token (and its logprob) out of the output")
    g.add_argument("--min-policy-version", type=int, default=0)
    return p


#: Exit status when stdout is closed before everything was written: 128 + SIGPIPE, what a shell
#: reports for a command that a closed pipe killed.
EXIT_BROKEN_PIPE = 141


def _discard_stdout() -> None:
    """Points stdout's file descriptor at /dev/null, so that the interpreter's flush at exit
    does not fail again on the closed pipe (a stdout without a descriptor is left alone)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        status = _main(argv)
        # Buffered output to a closed pipe fails here, not at the interpreter's exit.
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE


def _main(argv: Optional[List[str]]) -> int:
    args = _parser().parse_args(argv)
    _merge_connection_options(args)
    if args.command == "keygen":
        public, secret = curve_keypair()
        print(json.dumps({"public": public, "secret": secret}))
        return 0
    try:
        server_key = _key_arg(args.curve_server_key, secret=False)
        secret = _key_arg(args.curve_secret_key, secret=True)
        endpoints = args.endpoint + list(getattr(args, "endpoints", None) or [])
        client = VrollClient(endpoints or ["tcp://127.0.0.1:5555"],
                             curve_server_key=server_key,
                             curve_client_keys=client_keys_from_secret(secret) if secret else None,
                             timeout_s=args.timeout_s)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "generate":
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                    top_k=args.top_k, max_tokens=args.max_tokens,
                                    stop_token_ids=args.stop_token_ids,
                                    include_stop_token=not args.exclude_stop_token, seed=args.seed)
            for out in client.generate(args.prompt, params, n=args.n,
                                       min_policy_version=args.min_policy_version):
                print(json.dumps(dataclasses.asdict(out)))
        else:
            method = getattr(client, args.command.replace("-", "_"))
            replies = {endpoint: reply or "ok" for endpoint, reply in method().items()}
            print(json.dumps(replies, indent=2, default=str))
        return 0
    except VrollError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # arguments the client refuses before sending (e.g. --n 0)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close(linger_ms=100)


if __name__ == "__main__":
    sys.exit(main())
