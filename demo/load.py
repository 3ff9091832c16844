"""The load our users live through, sent through vLLM's OpenAI API.

- a multi-turn chat whose context grows every turn (several at once);
- concurrent requests that share one long system prompt (prefix build-up);
- streaming clients that disconnect mid-answer (aborts).

Every request carries its own W3C ``traceparent``, so the client knows the
trace id under which each request's spans arrive, and W3C baggage naming its
tenant (two teams share the server); each chat sends its session id
(``X-Session-ID``), as an agent or chat front end does.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass, field

import httpx

SYSTEM_PROMPT = (
    "You are a careful assistant for a team that runs large language models in production. "
    "You explain how the KV cache works, why blocks are shared between requests with a common "
    "prefix, what preemption costs, and how to read the telemetry of the block pool. "
) * 3

TENANTS = ("team-search", "team-support")
"""The two teams sharing the server, told apart by the ``tenant.id`` baggage entry."""
TENANT_KEY = "tenant.id"

QUESTIONS = [
    "Why does the memory line stay flat?",
    "What happens when the pool runs dry?",
    "How do prefix blocks get reused?",
    "Which requests were preempted, and why?",
    "What does an aborted client leave behind?",
    "How many blocks did my request hold?",
]


@dataclass
class SentRequest:
    scenario: str
    trace_id: str
    tenant: str | None = None
    session_id: str | None = None
    status: int = 0
    usage: dict = field(default_factory=dict)
    disconnected: bool = False


STAY_SECONDS = 30.0
"""The longest a streaming client told to stay does: a host so busy that nothing reads the
pool by then would keep it for ever."""


def traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


class LoadClient:
    def __init__(self, base_url: str, model: str, timeout: float = 300) -> None:
        self.model = model
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout)
        self.sent: list[SentRequest] = []

    async def close(self) -> None:
        await self.http.aclose()

    def _new(self, scenario: str, tenant: str, session_id: str | None = None) -> tuple[SentRequest, dict[str, str]]:
        trace_id, header = traceparent()
        sent = SentRequest(scenario, trace_id, tenant, session_id)
        self.sent.append(sent)
        headers = {"traceparent": header, "baggage": f"{TENANT_KEY}={tenant}"}
        if session_id is not None:
            headers["X-Session-ID"] = session_id
        return sent, headers

    async def complete(self, scenario: str, prompt: str, max_tokens: int, tenant: str = TENANTS[0]) -> SentRequest:
        sent, headers = self._new(scenario, tenant)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        response = await self.http.post("/v1/completions", json=body, headers=headers)
        sent.status = response.status_code
        sent.usage = response.json().get("usage", {})
        return sent

    async def chat(self, scenario: str, messages: list[dict], max_tokens: int, tenant: str = TENANTS[0],
                   session_id: str | None = None) -> tuple[SentRequest, str]:  # fmt: skip
        sent, headers = self._new(scenario, tenant, session_id)
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
        response = await self.http.post("/v1/chat/completions", json=body, headers=headers)
        sent.status = response.status_code
        payload = response.json()
        sent.usage = payload.get("usage", {})
        if "choices" not in payload:
            raise RuntimeError(f"vLLM answered {response.status_code}: {payload}")
        return sent, payload["choices"][0]["message"]["content"]

    async def stream_then_disconnect(self, scenario: str, prompt: str, chunks_before_leaving: int,
                                     tenant: str = TENANTS[1], max_tokens: int = 1000,
                                     stay_until: threading.Event | None = None,
                                     stay_seconds: float = STAY_SECONDS) -> SentRequest:  # fmt: skip
        """Leaves after ``chunks_before_leaving`` chunks and, with ``stay_until``, not before
        it is set: an answer that ends on its own first (at ``max_tokens``) is followed by
        another, for ``stay_seconds`` at the most. The last request sent is returned."""
        deadline = time.monotonic() + stay_seconds
        while True:
            sent = await self._stream(scenario, prompt, chunks_before_leaving, tenant, max_tokens, stay_until)
            if sent.disconnected or stay_until is None or time.monotonic() > deadline:
                return sent

    async def _stream(self, scenario: str, prompt: str, chunks_before_leaving: int, tenant: str, max_tokens: int,
                      stay_until: threading.Event | None) -> SentRequest:  # fmt: skip
        sent, headers = self._new(scenario, tenant)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with self.http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            sent.status = response.status_code
            received = 0
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    received += 1
                    if received >= chunks_before_leaving and (stay_until is None or stay_until.is_set()):
                        sent.disconnected = True
                        break  # closing the stream drops the connection mid-answer
        return sent


async def growing_chat(
    client: LoadClient, chat_index: int, turns: int, max_tokens: int, together: asyncio.Barrier | None = None
) -> None:
    """One conversation of one session: every turn resends the whole history, so the
    context grows. With ``together``, the conversations send each turn at the same
    moment (busy hours). The chats alternate between the two tenants."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    tenant, session_id = TENANTS[chat_index % len(TENANTS)], f"chat-{chat_index}"
    for turn in range(turns):
        if together is not None:
            await together.wait()
        messages.append({"role": "user", "content": QUESTIONS[(chat_index + turn) % len(QUESTIONS)]})
        _, answer = await client.chat("multi-turn chat", messages, max_tokens, tenant, session_id)
        messages.append({"role": "assistant", "content": answer})


async def shared_prefix_burst(client: LoadClient, count: int, max_tokens: int) -> None:
    prompts = [f"{SYSTEM_PROMPT}\nQuestion {i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(count)]
    await asyncio.gather(*(client.complete("shared system prompt", p, max_tokens) for p in prompts))


async def disconnecting_streams(
    client: LoadClient, count: int, chunks_before_leaving: int = 2, stay_until: threading.Event | None = None
) -> None:
    await asyncio.gather(
        *(
            client.stream_then_disconnect(
                "client disconnects", f"Stream {i}: {QUESTIONS[i % 6]}", chunks_before_leaving, stay_until=stay_until
            )
            for i in range(count)
        )
    )


@dataclass
class LoadShape:
    chats: int = 6
    turns: int = 4
    chat_max_tokens: int = 96
    burst: int = 8
    burst_max_tokens: int = 32
    streams: int = 4


async def run_load(
    base_url: str, model: str, shape: LoadShape, progress=None, streams_stay_until: threading.Event | None = None
) -> list[SentRequest]:
    """The three scenarios, one after another; ``progress(text)`` is told when each starts.
    With ``streams_stay_until``, the streaming clients leave only once it is set: they come
    last, alone, so that staying adds no pressure on the chats' blocks."""
    client = LoadClient(base_url, model)
    together = asyncio.Barrier(shape.chats)
    scenarios = (
        (
            f"{shape.burst} requests sharing one system prompt",
            lambda: shared_prefix_burst(client, shape.burst, shape.burst_max_tokens),
        ),
        (
            f"{shape.chats} chats x {shape.turns} growing turns",
            lambda: asyncio.gather(
                *(growing_chat(client, i, shape.turns, shape.chat_max_tokens, together) for i in range(shape.chats))
            ),
        ),
        (
            f"{shape.streams} streaming clients disconnect mid-answer",
            lambda: disconnecting_streams(client, shape.streams, stay_until=streams_stay_until),
        ),
    )
    try:
        for label, start in scenarios:
            if progress:
                progress(label)
            await start()
    finally:
        await client.close()
    return client.sent
