"""A real HTTP server on 127.0.0.1 serving Prometheus pages that change between scrapes.

For testing scrapers (``kvreuse hitrate``) without an engine: each GET of ``/metrics`` returns the
next page of a script (the last one repeats), or whatever a callback returns. Page builders
produce the exposition format vLLM and SGLang really emit (prometheus_client: ``# HELP``,
``# TYPE``, ``_total`` and ``_created`` samples, ``engine``/``model_name`` labels).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


def vllm_page(
    hits: float,
    queries: float,
    *,
    model: str = "test-model",
    engines: int = 1,
    suffix: bool = True,
    legacy_gpu_names: bool = False,
) -> str:
    """vLLM's prefix-cache counters split evenly over ``engines`` engine processes.

    ``suffix=False`` gives the bare counter names older Prometheus clients emit;
    ``legacy_gpu_names`` the ``vllm:gpu_prefix_cache_*`` names of older vLLM releases.
    """
    base = "vllm:gpu_prefix_cache" if legacy_gpu_names else "vllm:prefix_cache"
    end = "_total" if suffix else ""
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
    ]
    lines += [
        f'vllm:num_requests_running{{engine="{e}",model_name="{model}"}} 1.0'
        for e in range(engines)
    ]
    for name, total, doc in (
        ("queries", queries, "Prefix cache queries, in terms of number of queried tokens."),
        ("hits", hits, "Prefix cache hits, in terms of number of cached tokens."),
    ):
        lines.append(f"# HELP {base}_{name}{end} {doc}")
        lines.append(f"# TYPE {base}_{name}{end} counter")
        for engine in range(engines):
            labels = f'engine="{engine}",model_name="{model}"'
            lines.append(f"{base}_{name}{end}{{{labels}}} {total / engines!r}")
            if suffix:
                lines.append(f"{base}_{name}_created{{{labels}}} 1.7e+09")
    return "\n".join(lines) + "\n"


def sglang_page(cached: float, prompt: float, *, model: str = "test-model") -> str:
    """SGLang's counters: cached tokens per ``cache_source`` (device/host) and prompt tokens."""
    device, host = cached * 0.75, cached * 0.25
    return (
        "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE sglang:prompt_tokens_total counter\n"
        f'sglang:prompt_tokens_total{{model_name="{model}"}} {prompt!r}\n'
        "# HELP sglang:cached_tokens_total Number of cached prompt tokens.\n"
        "# TYPE sglang:cached_tokens_total counter\n"
        f'sglang:cached_tokens_total{{cache_source="device",model_name="{model}"}} {device!r}\n'
        f'sglang:cached_tokens_total{{cache_source="host",model_name="{model}"}} {host!r}\n'
        "# HELP sglang:cache_hit_rate The cache hit rate\n"
        "# TYPE sglang:cache_hit_rate gauge\n"
        f'sglang:cache_hit_rate{{model_name="{model}"}} 0.5\n'
    )


class MetricsServer:
    """Serves ``pages`` in order on ``http://127.0.0.1:PORT/metrics``; use as a context manager.

    ``page_for`` (scrape index -> page text) replaces the script when given. ``scrapes`` counts
    the GETs served.
    """

    def __init__(
        self,
        pages: Sequence[str] = (),
        page_for: Callable[[int], str] | None = None,
        status: int = 200,
    ) -> None:
        if not pages and page_for is None:
            raise ValueError("give pages or page_for")
        self._pages = list(pages)
        self._page_for = page_for
        self._status = status
        self._lock = threading.Lock()
        self.scrapes = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = server._next_page().encode("utf-8")
                self.send_response(server._status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def _next_page(self) -> str:
        with self._lock:
            index = self.scrapes
            self.scrapes += 1
        if self._page_for is not None:
            return self._page_for(index)
        return self._pages[min(index, len(self._pages) - 1)]

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/metrics"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
