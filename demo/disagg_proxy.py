"""A prefill/decode proxy in front of two vLLM servers, forwarding W3C trace context.

    python -m demo.disagg_proxy --prefill URL --decode URL [--port N]

vLLM's disaggregated serving puts a proxy before two servers that share KV
through a KV connector: the prefill server computes the prompt's KV (one token,
``max_tokens=1``) and hands it to the connector, then the decode server gets the
original request with the prefill answer's ``kv_transfer_params`` and loads
that KV instead of recomputing it. This is that pattern, as in vLLM's own toy
proxy, small enough for the demo and the tests.

The proxy is also where one client request becomes two server requests, so it
is where the trace would break: it opens a SERVER span under the caller's
``traceparent`` and injects that span's context into both outgoing requests,
so the two servers' HTTP and KV spans land in the caller's trace.
"""

from __future__ import annotations

import argparse
from contextlib import asynccontextmanager
from typing import Any

import httpx
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TRACER_NAME = "otel_kvcache.demo.disagg_proxy"
ROUTES = ("/v1/completions", "/v1/chat/completions")

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What vLLM's proxies send the prefill server: compute the prompt, keep its KV for a remote decode."""


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill server: the same prompt, one token, no stream."""
    request = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    request.pop("stream_options", None)
    if "max_completion_tokens" in body:
        request["max_completion_tokens"] = 1
    return request


def decode_request(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The original request, with what the prefill server said about its KV.

    A connector that shares KV by content (the example shared-storage connector
    finds it by the prompt's tokens) returns no ``kv_transfer_params``: then the
    decode request goes as it came and the connector finds the KV on its own."""
    if not kv_transfer_params:
        return body
    return {**body, "kv_transfer_params": kv_transfer_params}


def build_app(
    prefill_url: str, decode_url: str, timeout: float = 300, tracer_provider: trace.TracerProvider | None = None
) -> Starlette:
    """The proxy as an ASGI app (run it with uvicorn, in a thread for a test); its spans
    go to ``tracer_provider``, the global one by default."""
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
    client = httpx.AsyncClient(timeout=timeout)

    async def proxy(request: Request) -> Response:
        path = request.url.path
        body = await request.json()
        span = tracer.start_span(
            f"disagg_proxy POST {path}",
            context=propagate.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": path},
        )
        headers: dict[str, str] = {}
        propagate.inject(headers, context=trace.set_span_in_context(span))
        try:
            prefill = await client.post(prefill_url.rstrip("/") + path, json=prefill_request(body), headers=headers)
            if prefill.status_code != 200:
                span.set_status(Status(StatusCode.ERROR, f"prefill answered {prefill.status_code}"))
                span.end()
                return Response(prefill.content, prefill.status_code, media_type="application/json")
            kv_transfer_params = prefill.json().get("kv_transfer_params")
            span.set_attribute("otel_kvcache.disagg.kv_transfer_params", kv_transfer_params is not None)
            decode = client.build_request(
                "POST", decode_url.rstrip("/") + path, json=decode_request(body, kv_transfer_params), headers=headers
            )
            response = await client.send(decode, stream=True)
        except Exception as error:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 500:
            span.set_status(Status(StatusCode.ERROR))

        async def relay():
            """The decode answer as it comes (streamed or not); the span ends with it."""
            try:
                async for chunk in response.aiter_bytes():
                    yield chunk
            finally:
                await response.aclose()
                span.end()

        media_type = response.headers.get("content-type")
        return StreamingResponse(relay(), response.status_code, media_type=media_type)

    async def health(_: Request) -> Response:
        return JSONResponse({"prefill": prefill_url, "decode": decode_url})

    @asynccontextmanager
    async def lifespan(_: Starlette):
        async with client:
            yield

    routes = [Route(path, proxy, methods=["POST"]) for path in ROUTES]
    return Starlette(routes=[*routes, Route("/health", health)], lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's URL")
    parser.add_argument("--decode", required=True, help="the decode server's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()

    import uvicorn

    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
