"""vLLM's KV connectors (``vllm.distributed.kv_transfer``), as ``connectors.py`` reads them.

What each release does with a connector, and what that means here, is in
``docs/vllm-versions.md``; these are the reads themselves.
"""

from __future__ import annotations

import os
from typing import Any

from otel_kvcache import names


def kv_connector(scheduler: Any) -> Any | None:
    """The scheduler's KV connector (its scheduler side), or None."""
    return getattr(scheduler, "connector", None)


def connector_kv_role(scheduler: Any) -> str | None:
    """``producer`` or ``consumer`` for an engine configured as one (``kv_role``
    ``kv_producer`` or ``kv_consumer``); None for ``kv_both``."""
    config = scheduler.vllm_config.kv_transfer_config
    role = getattr(config, "kv_role", None)
    return {"kv_producer": names.ROLE_PRODUCER, "kv_consumer": names.ROLE_CONSUMER}.get(role)


def request_connector_role(kv_transfer_params: dict | None) -> str | None:
    """A request's role in a prefill/decode hand-off, from the parameters the proxy
    sent (read before the connector rewrites them): ``do_remote_decode`` (its KV goes
    on: producer), ``do_remote_prefill`` or a producer's span (its KV comes from one:
    consumer)."""
    if not kv_transfer_params:
        return None
    if kv_transfer_params.get("do_remote_decode"):
        return names.ROLE_PRODUCER
    if kv_transfer_params.get("do_remote_prefill") or names.PRODUCER_SPAN_PARAMETER in kv_transfer_params:
        return names.ROLE_CONSUMER
    return None


def connector_timeout_seconds(scheduler: Any) -> float:
    """How long a connector may keep a transfer going, by its own settings: Mooncake's
    ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``; NIXL's ``decoder_kv_blocks_ttl`` (its
    producer-side lease, ``kv_lease_duration``, is renewed while the consumer lives, so
    it bounds nothing); 480 s, their common default, for any other."""
    name = type(kv_connector(scheduler)).__name__
    extra = getattr(scheduler.vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
    if name.startswith("Mooncake"):
        try:
            return float(os.environ.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", 480))
        except ValueError:
            return 480.0
    if name.startswith("Nixl"):
        return float(extra.get("decoder_kv_blocks_ttl", 480))
    return 480.0


def kv_connector_output(model_runner_output: Any) -> Any | None:
    """The workers' connector output of a step (``KVConnectorOutput``), or None."""
    return getattr(model_runner_output, "kv_connector_output", None)


def waiting_for_remote_kvs_status() -> Any:
    """``RequestStatus.WAITING_FOR_REMOTE_KVS``: blocks allocated, KV on its way."""
    from vllm.v1.request import RequestStatus

    return RequestStatus.WAITING_FOR_REMOTE_KVS


def hands_kv_on_in_parameters(connector: Any) -> bool:
    """Whether the consumer needs the parameters the producer's connector returns (NIXL,
    Mooncake, MoRIIO): its None then means that nothing goes on. The others (the example
    connector, LMCache, the offloading and storage connectors) move KV through storage and
    return none."""
    name = type(connector).__name__
    return name.startswith(("Nixl", "MoRIIO")) or name == "MooncakeConnector"


def statuses_handing_kv_on() -> frozenset:
    """The finishes after which a producer's KV goes on to a consumer: length-capped or
    stopped (NIXL; Mooncake and MoRIIO take length-capped ones only)."""
    from vllm.v1.request import RequestStatus

    return frozenset({RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED})


def block_ids_of(manager: Any, request_id: str) -> list[int]:
    """The request's block ids over all KV-cache groups."""
    return [block_id for group in manager.get_block_ids(request_id) for block_id in group]
