"""What a model's KV cache groups mean for its prefix cache: where a hit can end.

vLLM hashes a prompt every ``hash_block_size`` tokens (``Request.block_hashes``):
the scheduler's block size on one group, and on a model of several groups the
GCD of their block sizes or ``--prefix-match-unit`` (``resolve_kv_cache_block_sizes``,
0.30 on). That is the unit every prefix number here is counted in.

On one full-attention group every unit of a cached prefix can end a hit. On a
hybrid model (attention beside sliding-window or Mamba/GDN groups) a hit ends
only where every group holds an entry for the prefix there: a Mamba group keeps
its state at a few checkpoints (the prompt's tail, a junction another request
stopped at, every ``prefix_cache_retention_interval`` tokens), a sliding-window
group the window before them, and a full-attention group whose blocks are longer
than a unit its full blocks and the prompt's tail. vLLM keys each group's entries
by the unit's hash and the group's id (``make_block_hash_with_group_id``): the
entries of the groups other than a full-attention group counted in units
(``PrefixLayout.checked``) tell where a hit could end, and they reach the free
queue with their blocks (``entries_reader``), mid-run for a Mamba or sliding-window
group. Which checkpoints vLLM keeps is its own policy, read here from what it
cached, never modelled.

A lookup's full-attention hit (``Request.shared_prefix_boundary``, where it ran
past the hit the other groups allowed) says how far the attention blocks are in
the cache now, held by running requests or free; the other groups' entries there
may be held too, and are read from vLLM's prefix cache (``cached_entries_reader``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import ceil
from operator import attrgetter
from typing import Any, NamedTuple

from otel_kvcache.vllm_compat import internals
from otel_kvcache.vllm_compat.blocks import block_hash_reader, real_blocks

FULL_ATTENTION_MANAGER = "FullAttentionManager"


class PrefixLayout(NamedTuple):
    """An engine's prefix cache, as the miss reasons and the what-if curve count it."""

    unit: int
    """Tokens per prefix hash (``hash_block_size``): the unit of lookups, hits and frees."""
    stride: int = 1
    """Units per block of the first full-attention group: a block of the pool, as the
    what-if curve counts a freed prefix's depth (1 where there is no such group)."""
    attention: bytes | None = None
    """That group's key suffix where its blocks are longer than a unit (its entries are
    then among ``checked``), else None."""
    checked: tuple[bytes, ...] = ()
    """The key suffixes of the groups whose entries a hit needs at its end: empty on a
    model whose every unit can end a hit (one full-attention group). A full-attention
    group whose blocks are units is not among them: a request that left an entry of the
    others at a unit had its attention blocks cached up to there."""

    @property
    def hybrid(self) -> bool:
        """Whether a hit can end only where other groups hold entries too."""
        return bool(self.checked)


def single_group(block_size: int) -> PrefixLayout:
    return PrefixLayout(unit=block_size)


def prefix_layout(scheduler: Any) -> PrefixLayout:
    """The scheduler's prefix layout (``PrefixLayout``)."""
    if internals.has("hash_block_size"):
        unit = scheduler.hash_block_size
    else:  # its fallback, the scheduler's block size
        unit = scheduler.block_size if internals.has("block_size") else scheduler.cache_config.block_size
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    if len(managers) == 1 and type(managers[0]).__name__ == FULL_ATTENTION_MANAGER:
        return single_group(unit)
    suffixes = _group_key_suffixes(managers)
    if suffixes is None:  # keys that are not hash + suffix: a vLLM we do not know
        return single_group(unit)
    cacheable = [manager for manager in managers if getattr(manager.kv_cache_spec, "prefix_cacheable", True)]
    attention = next((m for m in cacheable if type(m).__name__ == FULL_ATTENTION_MANAGER), None)
    unit_blocks = attention is not None and attention.block_size == unit
    checked = tuple(suffixes[m.kv_cache_group_id] for m in cacheable if not (m is attention and unit_blocks))
    return PrefixLayout(
        unit=unit,
        stride=attention.block_size // unit if attention is not None else 1,
        attention=None if attention is None or unit_blocks else suffixes[attention.kv_cache_group_id],
        checked=checked,
    )


def _group_key_suffixes(managers: Sequence[Any]) -> dict[int, bytes] | None:
    """Group id -> what vLLM appends to a prefix hash to key that group's entries, or
    None where its keys are not that (``make_block_hash_with_group_id``)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    suffixes = {}
    for manager in managers:
        group = manager.kv_cache_group_id
        suffix = make_block_hash_with_group_id(b"", group)
        if not isinstance(suffix, bytes) or make_block_hash_with_group_id(b"\x01" * 32, group) != b"\x01" * 32 + suffix:
            return None
        suffixes[group] = suffix
    return suffixes


def attention_reach_reader() -> Callable[[Any], int]:
    """A looked-up request's full-attention hit in tokens where it ran past the hit the
    other groups allowed (``Request.shared_prefix_boundary``, read once its admission
    succeeded), else 0."""
    if not internals.has("shared_prefix_boundary"):
        return lambda request: 0
    return attrgetter("shared_prefix_boundary")


def entries_reader(block_pool: Any, layout: PrefixLayout) -> Callable[[Sequence[Any]], list] | None:
    """A function giving, for blocks vLLM gives back to its free queue with their prefix
    (in one ``append_n``), the entries of the ``checked`` groups they hold: each block's
    key and its partial-block keys (none where vLLM keeps none apart). None on a layout
    that checks no group."""
    if not layout.checked:
        return None
    checked = frozenset(layout.checked)
    key_of = block_hash_reader(block_pool.blocks[0])
    extra = block_pool.cached_block_hashes_by_block if internals.has("cached_block_hashes_by_block") else {}
    suffix_length = len(layout.checked[0])

    def entries_of(blocks: Sequence[Any]) -> list:
        # vLLM frees one group's blocks at a time: its first and last block tell.
        first, last = key_of(blocks[0]), key_of(blocks[-1])
        if (first is None or first[-suffix_length:] not in checked) and (
            last is None or last[-suffix_length:] not in checked
        ):
            return []
        entries = []
        for block in blocks:
            key = key_of(block)
            if key is not None and key[-suffix_length:] in checked:
                entries.append(key)
            more = extra.get(block.block_id) if extra else None
            if more:
                entries.extend(key for key in more if key[-suffix_length:] in checked)
        return entries

    return entries_of


def cached_entries_reader(block_pool: Any, type_managers: Sequence[Any],
                          layout: PrefixLayout) -> Callable[[str, list], list] | None:  # fmt: skip
    """A function giving, for a request and units of its lookup whose attention blocks are
    in the cache (``attention_reach_reader``), the other checked groups' entries at them
    that others' blocks hold in vLLM's prefix cache now (read once its admission succeeded,
    its own new blocks left out): held by running requests, they never reached the free
    queue. None on a layout that checks no other group."""
    if not internals.has("cached_block_hash_to_block"):
        return None
    suffixes = _group_key_suffixes(type_managers) or {}
    groups = tuple(
        (manager.req_to_blocks, suffix)
        for manager in type_managers
        if (suffix := suffixes.get(manager.kv_cache_group_id)) in layout.checked and suffix != layout.attention
    )
    if not groups:
        return None
    cached = block_pool.cached_block_hash_to_block

    def cached_entries(request_id: str, keys: list) -> list:
        entries = []
        for blocks_of, suffix in groups:
            own = set(map(id, blocks_of.get(request_id, ())))
            for key in keys:
                block = cached.get_one_block(key + suffix)
                if block is not None and id(block) not in own:
                    entries.append(key + suffix)
        return entries

    return cached_entries


def hit_blocks_counter(type_managers: Sequence[Any]) -> Callable[[str, int], int] | None:
    """A function counting the blocks a request's prefix hit of so many tokens gave it,
    across its groups, vLLM's null placeholders left out, read from its block lists
    once its admission succeeded (they begin with the hit's blocks); None on one
    full-attention group, where that is the hit's tokens over the block size."""
    if len(type_managers) == 1 and type(type_managers[0]).__name__ == FULL_ATTENTION_MANAGER:
        return None
    groups = tuple((manager.req_to_blocks, manager.block_size) for manager in type_managers)

    def hit_blocks(request_id: str, hit_tokens: int) -> int:
        if not hit_tokens:
            return 0
        count = 0
        for blocks_of, block_size in groups:
            blocks = blocks_of.get(request_id)
            if blocks:
                count += real_blocks(blocks[: ceil(hit_tokens / block_size)])
        return count

    return hit_blocks
