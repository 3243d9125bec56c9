"""``kvreuse lab``: serve the interactive lab (the belgavi example) on this machine."""

from __future__ import annotations

import argparse
import threading
import webbrowser
from typing import Any

from kvreuse.cli.args import positive_int
from kvreuse.defaults import LAB_HOST as DEFAULT_HOST
from kvreuse.defaults import LAB_MAX_CONCURRENT_RUNS as MAX_CONCURRENT_RUNS
from kvreuse.defaults import LAB_PORT as DEFAULT_PORT
from kvreuse.defaults import lab_base_url
from kvreuse.errors import ConfigError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "lab",
        help="serve the interactive prefix-caching lab in a local web page",
        description="Serve a local page that runs the fleet simulator with your settings and "
        "animates the result: prompts per replica (cached prefix vs prefilled), replica 1's "
        "radix tree halfway through, hit-rate and TTFT tiles, and the four missions. Works "
        "offline; nothing is fetched from the internet.",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default {DEFAULT_HOST}; the lab is meant for this machine)",
    )
    parser.add_argument(
        "--port",
        type=positive_int,
        default=DEFAULT_PORT,
        help=f"port to listen on (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--max-concurrent-runs", type=positive_int, default=MAX_CONCURRENT_RUNS, metavar="N",
        help="simulations run at once; more wait briefly, then get 503 "
        f"(default {MAX_CONCURRENT_RUNS})",
    )
    parser.add_argument("--open", action="store_true", help="open the page in a web browser")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.port > 65535:
        raise ConfigError(f"--port must be at most 65535, got {args.port}")
    # Imported here so `kvreuse --help` works without the gateway extra installed.
    try:
        import uvicorn

        from kvreuse.web.app import create_app
    except ImportError as exc:
        raise ConfigError(
            f"the lab needs starlette and uvicorn ({exc.name} is missing): "
            "pip install 'kvreuse[gateway]'"
        ) from None
    url = lab_base_url(args.host, args.port)
    print(f"kvreuse lab: serving {url} (Ctrl-C to stop)", flush=True)
    if args.open:
        # After a moment, so the server is listening when the browser asks.
        threading.Timer(0.8, webbrowser.open, args=(url,)).start()
    app = create_app(max_concurrent_runs=args.max_concurrent_runs)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
