"""`llmserve launch`: a one-command fleet on one machine: N `llmserve serve` replicas and a router.

    llmserve launch --replicas 2 --port 8080 [any `llmserve serve` flag ...]

The replicas listen on 127.0.0.1:BASE_PORT+i (BASE_PORT defaults to --port + 1) and share the
machine's threads (--num-threads is the total, split evenly). The router listens on --host:--port
and is the only entry point; the --ssl-* flags are its (https outside, plain http to the replicas on
loopback), the API keys both its and the replicas'. Ctrl-C / SIGTERM stops the router and every replica; a replica that
dies is restarted (up to --max-restarts times). Replicas also get SIGTERM if the launcher itself
is killed (Linux parent-death signal).

`--replica-command` runs something else as replicas (another server, vLLM, a fake backend for
tests): a command line with {host}, {port} and {threads} placeholders.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading

from llmserve.serve_config import add_serve_arguments, read_config_file

log = logging.getLogger("llmserve.launch")

# serve flags the launcher sets itself, per replica (--host and --port are the router's, --num-threads the
# total, --api-key the router's and the replicas', TLS the router's: the replicas listen on loopback, plain http)
_TLS = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")
_OWN = {"host", "port", "num_threads", "api_key", "help", *_TLS}


def add_arguments(p: argparse.ArgumentParser) -> None:
    n = len(p._actions)
    add_serve_arguments(p)  # every `llmserve serve` flag, passed on to the replicas (serve_argv)
    p.set_defaults(_serve_actions=p._actions[n:])
    g = p.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=2, help="number of servers")
    g.add_argument("--base-port", type=int, default=None, help="first replica port (default: --port + 1)")
    g.add_argument(
        "--replica-command",
        default=None,
        help="run this instead of `llmserve serve` (placeholders {host} {port} {threads})",
    )
    g.add_argument("--max-restarts", type=int, default=5, help="restarts per replica")
    g.add_argument("--router-policy", dest="router_policy", default="cache_aware", help="routing policy of the router")
    g.add_argument("--router-max-retries", dest="router_max_retries", type=int, default=2)
    g.add_argument("--router-health-interval", dest="router_health_interval", type=float, default=2.0)


def serve_argv(args) -> list[str]:
    """Rebuild the `llmserve serve` flags the user gave (those not at their default)."""
    parser_actions = getattr(args, "_serve_actions", None) or []
    out: list[str] = []
    for a in parser_actions:
        if a.dest in _OWN or not a.option_strings:
            continue
        value = getattr(args, a.dest, a.default)
        if value == a.default:
            continue
        flag = next((s for s in a.option_strings if s.startswith("--")), a.option_strings[0])
        if isinstance(a, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(flag)
        elif isinstance(a, argparse._AppendAction):
            for v in value or []:
                out += [flag, str(v)]
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def _pdeathsig() -> None:
    """In the child: get SIGTERM when the launcher dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Replica:
    def __init__(self, index: int, argv: list[str], port: int):
        self.index, self.argv, self.port = index, argv, port
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        log.info("replica %d: %s", self.index, shlex.join(self.argv))
        self.proc = subprocess.Popen(self.argv, preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def replica_commands(args, n: int, base_port: int) -> list[list[str]]:
    total = args.num_threads or os.cpu_count() or 1
    threads = max(1, total // n)
    cmds = []
    for i in range(n):
        port = base_port + i
        if args.replica_command:
            cmd = shlex.split(args.replica_command.format(host="127.0.0.1", port=port, threads=threads))
        else:
            cmd = [
                sys.executable,
                "-m",
                "llmserve.cli",
                "serve",
                *serve_argv(args),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num-threads",
                str(threads),
            ]
            if args.api_key:
                cmd += ["--api-key", *([args.api_key] if isinstance(args.api_key, str) else args.api_key)]
        cmds.append(cmd)
    return cmds


def apply_fleet_config(args, argv_flags: set[str]) -> None:
    """`replicas` and `num_threads` (the total) from --config (what `llmserve tune` writes), unless given as flags;
    the replicas read the rest of the file themselves (--config is passed on)."""
    if not args.config:
        return
    data = read_config_file(args.config)
    for key in ("replicas", "num_threads"):
        if key in data and key not in argv_flags:
            setattr(args, key, int(data[key]))


def run(args) -> int:
    import uvicorn

    from llmserve.config import flag_dests
    from llmserve.security import resolve_api_keys, uvicorn_ssl

    from .app import Router, RouterConfig, build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    apply_fleet_config(args, flag_dests(sys.argv[2:]))
    n = max(1, args.replicas)
    base = args.base_port or args.port + 1
    replicas = [Replica(i, cmd, base + i) for i, cmd in enumerate(replica_commands(args, n, base))]
    stopping = threading.Event()

    def supervise() -> None:
        while not stopping.wait(1.0):
            for r in replicas:
                if r.proc is not None and r.proc.poll() is not None and not stopping.is_set():
                    if r.restarts >= args.max_restarts:
                        continue
                    r.restarts += 1
                    log.warning(
                        "replica %d exited with %s; restart %d/%d",
                        r.index,
                        r.proc.returncode,
                        r.restarts,
                        args.max_restarts,
                    )
                    r.start()

    try:
        keys = resolve_api_keys(args.api_key, args.api_key_file)  # the replicas read --api-key-file too
        config = RouterConfig(
            backends=[f"http://127.0.0.1:{r.port}" for r in replicas],
            policy=args.router_policy,
            max_retries=args.router_max_retries,
            health_interval=args.router_health_interval,
            api_key=list(keys),
            backend_api_key=keys[0] if keys else None,
            **{name: getattr(args, name) for name in _TLS},
        )
        tls = uvicorn_ssl(config, "llmserve launch")
    except ValueError as e:
        raise SystemExit(str(e)) from e
    router = Router(config)

    # uvicorn turns SIGTERM / Ctrl-C into a graceful shutdown, then re-raises the signal with
    # the handlers it found: make those exit cleanly so the finally block stops the replicas.
    def _exit(sig, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    try:
        for r in replicas:
            r.start()
        threading.Thread(target=supervise, daemon=True).start()
        log.info("router on http://%s:%d over %d replicas (ports %d-%d)", args.host, args.port, n, base, base + n - 1)
        uvicorn.run(
            build_app(router),
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            timeout_graceful_shutdown=5,
            **tls,
        )
    finally:
        stopping.set()
        for r in replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        for r in replicas:
            r.stop()
        log.info("fleet stopped")
    return 0
