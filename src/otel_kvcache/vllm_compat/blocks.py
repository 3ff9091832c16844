"""vLLM's KV blocks as otel-kvcache reads them: the block pool, each request's block
lists, the null block (a placeholder no request holds) and the blocks' references.

Where a release lacks an attribute (``internals``), what vLLM offers instead is read.
A request's fair share of them is the engine's arithmetic (``engine/attribution.fair_share``).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter, countOf
from typing import Any

from otel_kvcache.vllm_compat import internals

_REF_CNT = attrgetter("ref_cnt")
_IS_NULL = attrgetter("is_null")


def free_queue(block_pool: Any) -> Any:
    """The pool's free-block queue (LRU order: the head is evicted first)."""
    return block_pool.free_block_queue


def pool_size(block_pool: Any) -> int:
    """Block ids in the pool, the null block included."""
    return block_pool.num_gpu_blocks if internals.has("num_gpu_blocks") else len(block_pool.blocks)


def usable_blocks(block_pool: Any) -> int:
    """Blocks requests can hold: vLLM reserves one as a placeholder ("null block")
    that is never handed out."""
    return pool_size(block_pool) - 1


def blocks_by_request(type_manager: Any) -> dict[str, list]:
    """A KV-cache group's block lists by request id (a dict vLLM keeps for the manager's life)."""
    return type_manager.req_to_blocks


def deferred_frees(scheduler: Any) -> list:
    """``(fence step, blocks)`` whose return to the pool waits for an in-flight step (a
    consumer connector with async scheduling): referenced, and no request's (empty where
    vLLM has none to show). A connector's delayed free keeps the request instead."""
    return scheduler.deferred_frees if internals.has("deferred_frees") else []


def block_references(block_pool: Any) -> int:
    """References (``ref_cnt``) over the pool's blocks, the null block's left out: it is
    no request's, and its count follows the release's rules (from 0.33 on it stays 0)."""
    null_block = getattr(block_pool, "null_block", None)
    return sum(map(_REF_CNT, block_pool.blocks)) - (null_block.ref_cnt if null_block is not None else 0)


def may_hold_null_blocks(type_manager: Any) -> bool:
    """Whether a request's block list may hold vLLM's null block (placeholders for
    skipped blocks: sliding window, chunked local attention, Mamba, RSWA...).
    Plain full attention never does, so its held blocks are its list's length."""
    return type(type_manager).__name__ != "FullAttentionManager"


def block_hash_reader(block: Any) -> Any:
    """Reads a block's prefix hash: up to 0.33 ``KVCacheBlock.block_hash`` is a property
    over the ``_block_hash`` slot, which ``attrgetter`` reads without a Python call;
    0.34 made the slot itself ``block_hash``."""
    return attrgetter("_block_hash" if hasattr(block, "_block_hash") else "block_hash")


def real_blocks(blocks: Any, may_hold_null: bool = True) -> int:
    """Blocks in a block list, vLLM's null block (a placeholder) left out; with
    ``may_hold_null`` false (``may_hold_null_blocks``), just its length."""
    return len(blocks) - countOf(map(_IS_NULL, blocks), True) if may_hold_null else len(blocks)


def blocks_held_by_request(type_managers: tuple[tuple[Any, bool], ...]) -> dict[str, int]:
    """Request id -> the blocks the KV manager holds for it across its groups, for every
    request holding any (``(manager, may_hold_null_blocks(manager))`` pairs). Each
    group's block lists are copied with one C call first: safe off the engine thread."""
    holding: dict[str, int] = {}
    for manager, with_null_blocks in type_managers:
        for request_id, blocks in list(blocks_by_request(manager).items()):
            held = real_blocks(blocks, with_null_blocks)
            if held:
                holding[request_id] = holding.get(request_id, 0) + held
    return holding


def reference_counts(blocks: Any, may_hold_null: bool = True) -> list[int]:
    """The reference count (``ref_cnt``: how many block lists hold it) of each block in a
    block list, vLLM's null block left out; with ``may_hold_null`` false
    (``may_hold_null_blocks``), of every block."""
    if may_hold_null:
        blocks = [block for block in blocks if not block.is_null]
    return list(map(_REF_CNT, blocks))


def held_blocks_counter(type_managers: tuple[tuple[Any, bool], ...]) -> Callable[[str], int]:
    """A function counting the blocks the KV manager holds for a request, across its
    groups (``(manager, may_hold_null_blocks(manager))`` pairs). With one plain
    full-attention group, the most common model, that is one list's length."""
    if len(type_managers) == 1 and not type_managers[0][1]:
        blocks_of = blocks_by_request(type_managers[0][0]).get
        return lambda request_id: len(blocks_of(request_id, ()))

    # Read for each request a hybrid model's step gives blocks (``EngineTelemetry._read_peaks``),
    # on the engine thread: each group's lookup bound once and ``real_blocks`` inlined
    # (``docs/overhead.md#hybrid-models``).
    groups = tuple((blocks_by_request(manager).get, with_null_blocks) for manager, with_null_blocks in type_managers)

    def held_blocks(request_id: str) -> int:
        held = 0
        for blocks_of, with_null_blocks in groups:
            blocks = blocks_of(request_id)
            if blocks:
                held += len(blocks) - countOf(map(_IS_NULL, blocks), True) if with_null_blocks else len(blocks)
        return held

    return held_blocks
