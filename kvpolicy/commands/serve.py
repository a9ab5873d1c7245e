"""`kvpolicy serve`: run the decision service (uvicorn) for one policy file.

The server stack (starlette, uvicorn) is imported only here and in
kvpolicy.service, so the other commands start without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import logging
import socket
import sys

from kvpolicy.commands.common import bounded_float, bounded_int
from kvpolicy.errors import InputError
from kvpolicy.inputs.policy_loader import DEFAULT_POLICY
from kvpolicy.service.limits import Limits


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of serve."""
    parser.add_argument("--policy", "-p", default=None,
                        help="policy file to serve, reloaded when it changes (default: builtin:default)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1, loopback only; the service has no auth)")
    parser.add_argument("--port", type=bounded_int("--port", 0, 65535), default=8080, help="TCP port (default 8080; 0 picks a free one)")
    parser.add_argument("--reload-interval", type=bounded_float("--reload-interval", 0, 3600), default=1.0, metavar="SECONDS",
                        help="how often to check the policy files for changes (default 1; 0: only on SIGHUP)")
    from kvpolicy.service.api import MAX_BODY_BYTES

    parser.add_argument("--reload-settle", type=bounded_float("--reload-settle", 0, 3600), default=None,
                        metavar="SECONDS", help="a changed policy file is read only after its size and mtime have "
                                                "held still this long (default: twice --reload-interval)")
    defaults = Limits()
    parser.add_argument("--max-connections", type=bounded_int("--max-connections", 1, 100_000),
                        default=defaults.max_connections,
                        help=f"open connections at once; more get HTTP 503 (default {defaults.max_connections})")
    parser.add_argument("--header-timeout", type=bounded_float("--header-timeout", 0.1, 600),
                        default=defaults.header_timeout_s, metavar="SECONDS",
                        help="a request's headers must arrive within this many seconds of connecting or of the "
                             f"previous response, else the connection is closed (default {defaults.header_timeout_s:g})")
    parser.add_argument("--body-timeout", type=bounded_float("--body-timeout", 0.1, 600),
                        default=defaults.body_timeout_s, metavar="SECONDS",
                        help=f"the body must arrive within this many seconds of the headers, else HTTP 408 "
                             f"(default {defaults.body_timeout_s:g})")
    parser.add_argument("--idle-timeout", type=bounded_float("--idle-timeout", 0.1, 600),
                        default=defaults.idle_timeout_s, metavar="SECONDS",
                        help=f"an idle keep-alive connection is closed after this many seconds "
                             f"(default {defaults.idle_timeout_s:g})")
    parser.add_argument("--access-log", action="store_true", help="log every request (off by default: /metrics counts them)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                        help="server log level on stderr (default info)")
    parser.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto",
                        help="HTTP parser (default auto: httptools when installed, as the serve extra does)")
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                        help="event loop (default auto: uvloop when installed, as the serve extra does)")
    parser.epilog = (
        "Example: kvpolicy serve --policy team.yaml --port 8080\n"
        "         curl -s localhost:8080/v1/recommend -d '{\"model\": \"gpt-oss-20b\", \"gpu\": \"h100\"}'\n"
        "Endpoints: POST /v1/recommend, POST /v1/check, GET /v1/models, GET /v1/gpus, GET /healthz, GET /metrics.\n"
        "Reload: edit the file (checked every --reload-interval seconds) or `kill -HUP PID`; a broken edit is\n"
        "rejected and logged, and the last good policy keeps serving. A file is read only once its size and\n"
        "mtime have held still for a settle time; replace it atomically (write a temp file, then rename it over\n"
        "the policy: what editors and `git checkout` do) so a reload never sees a half-written file.\n"
        f"Limits: bodies over {MAX_BODY_BYTES // 1024} KiB get 413, request line plus headers over "
        f"{Limits().max_header_bytes // 1024} KiB are refused, and\n"
        "the connection and timeout flags above cut off slow or idle clients; numbers in bodies are checked\n"
        "for type and range (422 names the field)."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args: argparse.Namespace) -> int:
    """Load the policy, bind the socket, serve until interrupted."""
    try:
        import uvicorn

        from kvpolicy.service.app import create_app
    except ImportError as exc:
        raise InputError(f"kvpolicy serve needs the server stack ({exc.name} is missing). "
                         "Install it with `pip install starlette uvicorn httptools uvloop` (kvpolicy's `serve` "
                         "extra: `pip install '.[serve]'` in a checkout).") from None
    from kvpolicy.service.reload import PolicyHolder

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    log = logging.getLogger("kvpolicy.serve")
    if args.reload_interval < 0:
        raise InputError(f"--reload-interval must be 0 or more seconds, found {args.reload_interval:g}.")
    for option, module in (("--http httptools", "httptools"), ("--loop uvloop", "uvloop")):
        if option.split()[1] in (args.http, args.loop) and importlib.util.find_spec(module) is None:
            raise InputError(f"{option}: {module} is not installed; `pip install {module}` installs it.")
    settle = args.reload_settle if args.reload_settle is not None else 2 * args.reload_interval
    holder = PolicyHolder(args.policy or DEFAULT_POLICY, settle_s=settle)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if not _is_loopback(args.host):
        log.warning("listening on %s, beyond this machine: the service has no authentication", args.host)
    from kvpolicy.service.limits import guarded_protocol

    limits = Limits(max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                    body_timeout_s=args.body_timeout, idle_timeout_s=args.idle_timeout)
    app = create_app(holder, reload_interval_s=args.reload_interval, limits=limits)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log, lifespan="on",
                            http=guarded_protocol(args.http, limits), loop=args.loop, timeout_graceful_shutdown=5,
                            server_header=False, limit_concurrency=limits.max_connections,
                            timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]
                            h11_max_incomplete_event_size=limits.max_header_bytes)
    url_host = f"[{host}]" if ":" in host else host
    # Printed whatever the log level: with --port 0 this line is how callers learn the port.
    reload = f"every {args.reload_interval:g}s and on SIGHUP" if args.reload_interval else "on SIGHUP"
    print(f"kvpolicy serve: serving {holder.current.label} on http://{url_host}:{port} (reload: {reload})",
          file=sys.stderr, flush=True)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port, with a clear error when it cannot be had."""
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be between 0 and 65535, found {port}.")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port} ({exc.strerror or exc}). "
                         "Pick another --port, or check --host.") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
