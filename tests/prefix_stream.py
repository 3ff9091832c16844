"""A recorded request stream whose prefixes repeat at many distances, replayed through vLLM.

Half the requests open with one of twelve system prompts, picked by a Zipf law
(a few are shared by most requests, the rest seldom); the other half are turns
of forty chats, each turn's prompt the last one's, an answer and a new
question, so a chat's prefix comes back after however many other requests
arrived in between. The stream is fixed (seeded) and independent of the pool:
the same prompts arrive at the same steps whatever the pool's size.
"""

from __future__ import annotations

import functools
import random
import tempfile

from engine_harness import EngineHarness
from harness.offloading import OffloadingWorker, offloading
from harness.scheduler import LAYOUTS, VOCAB_SIZE, make_model_config, make_scheduler
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

BLOCK_SIZE = 16
POOL_BLOCKS = 600
"""The pool the instrumented replay runs with: it evicts, and preempts at half its size."""
ARRIVALS_PER_STEP = 2
HYBRID_REQUESTS = 600
"""The stream's first requests that the hybrid layouts' tests replay."""


def prompts(count: int = 900, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)

    def text(tokens: int) -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(tokens)]

    systems = [text(6 * BLOCK_SIZE) for _ in range(12)]
    zipf = [1 / (rank + 1) ** 1.1 for rank in range(len(systems))]
    chats: dict[int, list[int]] = {}
    stream = []
    for _ in range(count):
        if rng.random() < 0.45:
            stream.append(rng.choices(systems, zipf)[0] + text(rng.randrange(20, 50)))
            continue
        chat = rng.randrange(40)
        history = chats.get(chat)
        if history is None or len(history) > 1500:  # a new conversation
            history = text(2 * BLOCK_SIZE)
        prompt = history + text(rng.randrange(20, 60))
        chats[chat] = prompt + text(BLOCK_SIZE)  # the answer, as the next turn sends it back
        stream.append(prompt)
    return stream


def replay(
    engine: EngineHarness, stream: list[list[int]] | None = None, worker: OffloadingWorker | None = None
) -> EngineHarness:
    """Feeds the stream (or ``stream``) to ``engine``, ``ARRIVALS_PER_STEP`` requests a step, to the end;
    with an offload tier, its ``worker`` completes the tier's stores and loads a step later."""
    step = engine.step if worker is None else functools.partial(worker.step, engine)
    for index, prompt in enumerate(prompts() if stream is None else stream):
        engine.add(
            Request(
                request_id=f"stream-{index}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=8, ignore_eos=True),
                pooling_params=None,
                block_hasher=engine.block_hasher,
            )
        )
        if index % ARRIVALS_PER_STEP == ARRIVALS_PER_STEP - 1:
            step()
    for _ in range(5000):
        if not (engine.scheduler.has_requests() or (worker is not None and worker.jobs)):
            return engine
        step()
    raise AssertionError("requests still unfinished after 5000 steps")


def measured_hit_ratio(num_blocks: int) -> float:
    """vLLM's own hit ratio (its ``PrefixCacheStats``) for the stream on an uninstrumented
    pool of ``num_blocks``; run in a fresh process, where nothing is instrumented."""
    scheduler = make_scheduler(make_model_config(tempfile.mkdtemp()), num_blocks=num_blocks, max_num_seqs=32)
    engine = replay(EngineHarness(scheduler))
    return engine.truth.prefix_hits / engine.truth.prefix_queries


def measured_hybrid_hit_ratio(num_blocks: int, layout: str) -> float:
    """As ``measured_hit_ratio``, on one of ``harness.scheduler.LAYOUTS``, for the stream's
    first ``HYBRID_REQUESTS``."""
    scheduler = make_scheduler(
        make_model_config(tempfile.mkdtemp()), num_blocks=num_blocks, max_num_seqs=32, layout=LAYOUTS[layout]
    )
    engine = replay(EngineHarness(scheduler), prompts(count=HYBRID_REQUESTS))
    return engine.truth.prefix_hits / engine.truth.prefix_queries


def measured_tier_hit_ratio(gpu_blocks: int, tier_bytes: int | None) -> float:
    """vLLM's own hit ratio for the stream, its GPU pool's prefix hits and its offload tier's
    together (``PrefixCacheStats`` and the connector's), on an uninstrumented pool of
    ``gpu_blocks`` with an LRU tier of ``tier_bytes`` (None: no tier); run in a fresh process."""
    transfer = None if tier_bytes is None else offloading(tier_bytes, "lru")
    scheduler = make_scheduler(
        make_model_config(tempfile.mkdtemp()), num_blocks=gpu_blocks, max_num_seqs=32, kv_transfer_config=transfer
    )
    engine = replay(EngineHarness(scheduler), worker=None if transfer is None else OffloadingWorker())
    return (engine.truth.prefix_hits + engine.truth.connector_hits) / engine.truth.prefix_queries
