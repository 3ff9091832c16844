"""A request's fair share of the blocks it holds: each block counted once over all the
block lists holding it, so that the shares of every request sum to the blocks in use."""

from __future__ import annotations

from typing import Any

from otel_kvcache.vllm_compat.blocks import reference_counts


def fair_share(blocks: Any, may_hold_null: bool = True) -> float:
    """A request's blocks, each counted 1 / its reference count (``ref_cnt``: how many
    block lists hold it), vLLM's null block left out. Most blocks have one holder: they
    are counted in one C call (``list.count``), the shared ones one by one: run over every
    held block at each collection, it costs less than a division per block even with a
    fifth of them shared (``docs/overhead.md#attribution``)."""
    references = reference_counts(blocks, may_hold_null)
    alone = references.count(1)
    if alone == len(references):
        return float(alone)
    return alone + sum(1 / count for count in references if count > 1)
