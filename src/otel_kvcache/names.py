"""Every span, event, attribute and metric name otel-kvcache emits, defined once.

These names are the public contract: dashboards, collector rules and alerts
depend on them. Units are UCUM; counters carry no ``_total`` suffix.
"""

from typing import Final

from opentelemetry.semconv._incubating.attributes.hw_attributes import HW_ID, HW_NAME, HW_TYPE, HW_VENDOR
from opentelemetry.semconv._incubating.metrics.hw_metrics import (
    HW_GPU_MEMORY_LIMIT,
    HW_GPU_MEMORY_USAGE,
    HW_GPU_MEMORY_UTILIZATION,
    HW_GPU_UTILIZATION,
)
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GEN_AI_REQUEST_MODEL,
    GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
)
from opentelemetry.semconv._incubating.attributes.session_attributes import SESSION_ID as _SESSION_ID
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE

METER_SCOPE: Final = "otel_kvcache"
"""Instrumentation scope of every metric (and tracer) of this package."""

# --- Span -------------------------------------------------------------------

KV_REQUEST_SPAN: Final = "vllm.kv_cache.request"
"""One INTERNAL span per engine request, from arrival to the release of its blocks."""

# --- Span events ------------------------------------------------------------

EVENT_ADMITTED: Final = "kv_cache.admitted"
"""The request got its first KV blocks."""
EVENT_PREEMPTED: Final = "kv_cache.preempted"
"""The scheduler took all of the request's blocks back to make room."""
EVENT_RESUMED: Final = "kv_cache.resumed"
"""A preempted request got blocks again."""
EVENT_RELEASED: Final = "kv_cache.released"
"""The request ended and its blocks went back to the pool."""
EVENT_LEAK: Final = "kv_cache.leak"
"""At release: vLLM still attributes blocks to the request after freeing it."""
EVENT_ZOMBIE: Final = "kv_cache.zombie"
"""The request finished (or is gone) but still holds blocks past the grace period."""
EVENT_STUCK: Final = "kv_cache.stuck"
"""The request runs but has computed no token for many steps."""
EVENT_REMOTE_KV_READY: Final = "kv_cache.remote_kv_ready"
"""KV connector: the request's asynchronous load finished (vLLM's ``finished_recving``)."""
EVENT_LOAD_FAILED: Final = "kv_cache.load_failed"
"""KV connector: blocks of the request failed to load (vLLM's ``invalid_block_ids`` or
``failed_recving``); vLLM recomputes their tokens."""
EVENT_SEND_DONE: Final = "kv_cache.send_done"
"""KV connector: the transfer out of a finished request's blocks finished (vLLM's
``finished_sending``); the blocks go back to the pool."""
FINDING_SPAN: Final = "vllm.kv_cache.finding"
"""A leak finding about a request whose own span has ended: a child of that span."""

# --- Attributes -------------------------------------------------------------

REQUEST_ID: Final = "vllm.request.id"
"""The engine's request id, cut to ``OTEL_KVCACHE_CLIENT_VALUE_LENGTH_LIMIT`` characters (a
client may choose it: vLLM adopts a ``request_id`` in the body or an ``X-Request-Id``)."""
ORIGINAL_LENGTH_SUFFIX: Final = ".original_length"
"""An attribute whose client-chosen value was cut has its original length in ``<name>.original_length``."""
REQUEST_ID_ORIGINAL_LENGTH: Final = REQUEST_ID + ORIGINAL_LENGTH_SUFFIX
INPUT_TOKENS: Final = GEN_AI_USAGE_INPUT_TOKENS
"""Prompt tokens of the request."""
OUTPUT_TOKENS: Final = GEN_AI_USAGE_OUTPUT_TOKENS
"""Tokens the request generated."""
CACHE_READ_INPUT_TOKENS: Final = GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS
"""Prompt tokens whose KV was not computed: local prefix-cache hits plus, on an engine with a
KV connector, the tokens it loaded (``CONNECTOR_HIT_TOKENS``), summed over admissions."""
BLOCK_SIZE: Final = "vllm.kv_cache.block_size"
"""Tokens per KV block."""
BLOCKS_PEAK: Final = "vllm.kv_cache.blocks.peak"
"""Most blocks the request held at once."""
BLOCKS_ALLOCATED: Final = "vllm.kv_cache.blocks.allocated"
"""New blocks taken from the pool over the request's life, re-admissions included."""
BLOCKS_PREFIX_HIT: Final = "vllm.kv_cache.blocks.prefix_hit"
"""Blocks reused from the prefix cache, summed over admissions."""
BLOCKS_FREED: Final = "vllm.kv_cache.blocks.freed"
"""Blocks released when the request ended."""
PREEMPTIONS: Final = "vllm.kv_cache.preemptions"
"""Span attribute: times the request was preempted. Also a counter, ``{preemption}``."""
RECOMPUTED_TOKENS: Final = "vllm.kv_cache.recomputed_tokens"
"""Span attribute: computed tokens thrown away by the request's preemptions. Also an
observable counter, ``{token}``, over all requests."""
ALLOCATION_STALLS: Final = "vllm.kv_cache.allocation_stalls"
"""Span attribute: engine steps in which the request was scheduled but got no
blocks. Also a counter, ``{stall}``, of such request-steps."""
FINISH_REASON: Final = "vllm.request.finish_reason"
"""stop, length, abort, error, repetition or ignored."""
PREFIX_EVICTED_TOKENS: Final = "vllm.kv_cache.prefix.evicted_tokens"
"""Prompt tokens that missed the prefix cache only because their blocks had been
cached and then evicted before this request asked, summed over admissions."""
PREFIX_COLD_TOKENS: Final = "vllm.kv_cache.prefix.cold_tokens"
"""Prompt tokens that missed the prefix cache because their blocks had never been cached."""
PREEMPTED_FOR: Final = "vllm.kv_cache.preempted_for.request_id"
"""Event attribute of ``kv_cache.preempted``: the request whose allocation forced the
preemption (absent when vLLM preempted the very request it was scheduling). The
victim's span links to that request's span when it has ended first."""
PREEMPTED_FOR_ORIGINAL_LENGTH: Final = PREEMPTED_FOR + ORIGINAL_LENGTH_SUFFIX

# Who holds the KV cache (``attribution.py``).
SESSION_ID: Final = _SESSION_ID
"""vLLM's ``Request.session_id`` (the body's ``session_id``, ``X-Session-ID`` or ``vllm_xargs``),
cut as client values are. Never a metric attribute."""
SESSION_ID_ORIGINAL_LENGTH: Final = SESSION_ID + ORIGINAL_LENGTH_SUFFIX
MODEL: Final = GEN_AI_REQUEST_MODEL
"""The served model name, or the LoRA adapter's name for a LoRA request. Also a metric
attribute of the attribution metrics (``OTEL_KVCACHE_ATTRIBUTION``)."""
PRIORITY: Final = "vllm.request.priority"
"""vLLM's request priority (lower runs first under ``--scheduling-policy priority``)."""
OCCUPANCY: Final = "vllm.kv_cache.occupancy"
"""Span attribute, block-seconds (double): the blocks the request held, integrated over its
life. Also a counter, ``{block}.s``, by the attribution attributes, live requests included
up to each collection; rows with ``vllm.kv_cache.offload.medium`` are the offload tier's."""
SESSION_TURN_GAP: Final = "vllm.kv_cache.session.turn_gap"
"""Span attribute, seconds: for a request of a session this engine has seen, from that
session's previous request's release here to this request's arrival. Also a histogram,
``s``, by ``SESSION_PREFIX_KEPT``."""
SESSION_PREFIX_KEPT: Final = "vllm.kv_cache.session.prefix_kept"
"""Attribute of ``SESSION_TURN_GAP``'s histogram: true when none of the request's prompt
tokens missed the prefix cache because they had been evicted."""
HELD_BLOCKS: Final = "vllm.kv_cache.held_blocks"
"""Observable gauge, ``{block}``: blocks live requests hold now, by the attribution
attributes; a block k requests share counts 1/k to each, so the series sum to the used blocks.
Rows with ``vllm.kv_cache.offload.medium`` are the offload tier's blocks, by who stored them."""
METRIC_OVERFLOW: Final = "otel.metric.overflow"
"""The attribution series past ``OTEL_KVCACHE_ATTRIBUTION_LIMIT``, folded into one, as the
OpenTelemetry metrics SDK marks its own cardinality overflow."""
ATTRIBUTION_CHOICES: Final = (MODEL, PRIORITY)
"""What ``OTEL_KVCACHE_ATTRIBUTION`` may name besides the keys of ``OTEL_KVCACHE_BAGGAGE_KEYS``."""

CONNECTOR_NAME: Final = "vllm.kv_cache.connector.name"
"""The engine's KV connector class (``MultiConnector`` for several)."""
CONNECTOR_ROLE: Final = "vllm.kv_cache.connector.role"
"""``producer`` (its KV goes to another engine: the prefill side) or ``consumer`` (its KV
comes from one: the decode side), from the request's ``kv_transfer_params`` or the
engine's ``kv_role``; absent when neither says."""
ROLE_PRODUCER: Final = "producer"
ROLE_CONSUMER: Final = "consumer"
CONNECTOR_HIT_TOKENS: Final = "vllm.kv_cache.connector.hit_tokens"
"""Span attribute: prompt tokens loaded through the KV connector, summed over admissions
(vLLM's external computed tokens). Also a counter, ``{token}``."""
CONNECTOR_WAIT_SECONDS: Final = "vllm.kv_cache.connector.wait_seconds"
"""Span attribute: seconds the request spent in ``WAITING_FOR_REMOTE_KVS``."""
CONNECTOR_FAILED_BLOCKS: Final = "vllm.kv_cache.connector.failed_blocks"
"""Span and event attribute: the request's blocks whose load failed."""
CONNECTOR_RECOMPUTED_TOKENS: Final = "vllm.kv_cache.connector.recomputed_tokens"
"""Span and event attribute: tokens vLLM recomputes because a load failed."""
CONNECTOR_DELAYED_FREE_SECONDS: Final = "vllm.kv_cache.connector.delayed_free_seconds"
"""Span attribute: from the request's finish to the return of its blocks to the pool,
when the connector delayed the free (a send in progress)."""
PRODUCER_SPAN_PARAMETER: Final = "otel_kvcache_producer_span"
"""The key a producer adds to the ``kv_transfer_params`` it returns: its span's W3C
``traceparent``. A proxy passes the parameters on as they are (vLLM's disaggregated-serving
pattern), and the consumer's span links to that span; connectors ignore unknown keys."""
ZOMBIE_REASON: Final = "vllm.kv_cache.zombie.reason"
"""Event attribute of ``kv_cache.zombie``: ``ZOMBIE_FINISHED`` or ``ZOMBIE_CONNECTOR_TIMEOUT``."""
ZOMBIE_FINISHED: Final = "finished"
"""Finished (or gone from the scheduler) and still holding blocks past the grace period."""
ZOMBIE_CONNECTOR_TIMEOUT: Final = "connector_timeout"
"""Held for a KV connector's transfer past the connector's timeout."""
STUCK_REASON: Final = "vllm.kv_cache.stuck.reason"
"""Event attribute of ``kv_cache.stuck``: ``STUCK_NO_PROGRESS`` or ``STUCK_REMOTE_KV_WAIT``."""
STUCK_NO_PROGRESS: Final = "no_progress"
"""Running, and no token computed for many steps."""
STUCK_REMOTE_KV_WAIT: Final = "remote_kv_wait"
"""Waiting for remote KV past the connector's timeout."""
EVENT_PREFIX_HIT_TOKENS: Final = "vllm.kv_cache.prefix_hit_tokens"
"""Event attribute: local prefix-cache hit tokens of this admission."""
STUCK_STEPS: Final = "vllm.kv_cache.stuck_steps"
"""Event attribute: steps a running request went without computing a token."""
POOL_FREE_BLOCKS: Final = "vllm.kv_cache.pool.free_blocks"
"""Event attribute: blocks the pool could hand out at that moment (cached ones included)."""
POOL_USED_BLOCKS: Final = "vllm.kv_cache.pool.used_blocks"
"""Event attribute: blocks referenced by a request at that moment."""

BLOCK_STATE: Final = "vllm.kv_cache.block.state"
"""Metric attribute of ``vllm.kv_cache.blocks``: one of ``BLOCK_STATES``."""
BLOCK_STATE_USED: Final = "used"
BLOCK_STATE_CACHED: Final = "cached"
BLOCK_STATE_FREE: Final = "free"
BLOCK_STATES: Final = (BLOCK_STATE_USED, BLOCK_STATE_CACHED, BLOCK_STATE_FREE)

ENGINE_INDEX: Final = "vllm.engine.index"
"""Metric attribute: the engine's data-parallel rank (0 without data parallelism)."""

# --- Resource attributes ------------------------------------------------------

PROCESS_ROLE: Final = "vllm.process.role"
"""Resource attribute: which of vLLM's processes exported the data."""
ROLE_API_SERVER: Final = "api_server"
ROLE_DP_COORDINATOR: Final = "dp_coordinator"
ROLE_ENGINE_CORE: Final = "engine_core"
ROLE_WORKER: Final = "worker"
WORKER_RANK: Final = "vllm.worker.rank"
"""Resource attribute of worker processes: the worker's rank within its engine."""
API_SERVER_INDEX: Final = "vllm.api_server.index"
"""Resource attribute of the API servers vLLM starts (``--api-server-count``): which one."""

ERROR_TYPE_ATTRIBUTE: Final = ERROR_TYPE
"""Metric attribute of the instrumentation's own error counter: the exception type."""
HOOK: Final = "otel_kvcache.hook"
"""Metric attribute of the instrumentation's own error counter: the vLLM method wrapped."""

# --- Metrics ----------------------------------------------------------------

BLOCKS: Final = "vllm.kv_cache.blocks"
"""Observable gauge, ``{block}``: blocks per ``vllm.kv_cache.block.state``.
Also the event attribute for the blocks a request held (admitted, resumed) or
gave back (preempted, released)."""
BLOCKS_LIMIT: Final = "vllm.kv_cache.blocks.limit"
"""Observable gauge, ``{block}``: usable blocks in the pool (vLLM's null block excluded)."""
UTILIZATION: Final = "vllm.kv_cache.utilization"
"""Observable gauge, ``1``: used / limit. As in vLLM's ``kv_cache_usage_perc``,
evictable prefix-cache blocks count as free (they are in vLLM's free queue)."""
PREFIX_CACHE_MISSES: Final = "vllm.kv_cache.prefix_cache.misses"
"""Observable counter, ``{token}``: looked-up tokens the prefix cache did not serve, by ``MISS_REASON``."""
MISS_REASON: Final = "vllm.kv_cache.miss.reason"
MISS_EVICTED: Final = "evicted"
"""Cached before, evicted before the lookup."""
MISS_COLD: Final = "cold"
"""Never cached (as far as the history of freed blocks reaches: ``whatif.py``)."""
MISS_UNCACHEABLE: Final = "uncacheable"
"""The tail that does not fill a block, the last token, and requests that skip the cache."""
PROJECTED_HIT_RATIO: Final = "vllm.kv_cache.prefix_cache.projected_hit_ratio"
"""Observable gauge, ``1``: the share of looked-up tokens the prefix cache would have served with a
pool ``POOL_SCALE`` times as large, over the last ten minutes (``whatif.py``)."""
POOL_SCALE: Final = "vllm.kv_cache.pool.scale"
"""Attribute of ``PROJECTED_HIT_RATIO``: the pool size as a multiple of the real one."""
PROJECTED_PREEMPTION_FREE_SCALE: Final = "vllm.kv_cache.pool.projected_preemption_free_scale"
"""Observable gauge, ``1``: the smallest pool, as a multiple of the real one, that the last ten
minutes' peak demand (used blocks plus those of preempted requests) would have fit."""
EVICTIONS: Final = "vllm.kv_cache.evictions"
"""Counter, ``{block}``: prefix-cache blocks evicted for reuse."""
PREFIX_CACHE_QUERIES: Final = "vllm.kv_cache.prefix_cache.queries"
"""Counter, ``{token}``: tokens looked up in the prefix cache (as vLLM's PrefixCacheStats)."""
PREFIX_CACHE_HITS: Final = "vllm.kv_cache.prefix_cache.hits"
"""Counter, ``{token}``: tokens found in the prefix cache."""
REQUEST_BLOCKS: Final = "vllm.kv_cache.request.blocks"
"""Histogram, ``{block}``: peak blocks per finished request."""
REQUEST_PREFIX_HIT_RATIO: Final = "vllm.kv_cache.request.prefix_hit_ratio"
"""Histogram, ``1``: prefix-cache hit tokens / prompt tokens per finished request."""
REQUEST_PREEMPTIONS: Final = "vllm.kv_cache.request.preemptions"
"""Histogram, ``{preemption}``: preemptions per finished request."""
REQUEST_CONNECTOR_WAIT: Final = "vllm.kv_cache.request.connector_wait"
"""Histogram, ``s``: per finished request that waited for remote KV, the wait
(``CONNECTOR_WAIT_SECONDS``)."""
KV_MEMORY_USAGE: Final = "vllm.kv_cache.memory.usage"
"""Observable gauge, ``By``: KV bytes per ``vllm.kv_cache.block.state`` (blocks x bytes per block)."""
KV_MEMORY_LIMIT: Final = "vllm.kv_cache.memory.limit"
"""Observable gauge, ``By``: bytes of the usable KV pool."""

# --- Leaks and waste (the reconciler, the pool's evictions) ------------------------

ORPHANED_BLOCKS: Final = "vllm.kv_cache.orphaned_blocks"
"""Observable gauge, ``{block}``: block references no live request or deferred free accounts for."""
ZOMBIE_REQUESTS: Final = "vllm.kv_cache.zombie_requests"
"""Observable gauge, ``{request}``: finished or vanished requests still holding blocks past the grace period."""
ZOMBIE_BLOCKS: Final = "vllm.kv_cache.zombie_blocks"
"""Observable gauge, ``{block}``: blocks those zombie requests hold."""
STUCK_REQUESTS: Final = "vllm.kv_cache.stuck_requests"
"""Observable gauge, ``{request}``: running requests with no progress for many steps."""
TAIL_SLACK: Final = "vllm.kv_cache.tail_slack"
"""Observable gauge, ``{token}``: token slots allocated to running requests but not yet filled."""
TAIL_SLACK_RATIO: Final = "vllm.kv_cache.tail_slack.ratio"
"""Observable gauge, ``1``: tail slack over the token slots of the used blocks."""
CACHED_BLOCKS_HIT_AGAIN: Final = "vllm.kv_cache.cached_blocks.hit_again"
"""Observable gauge, ``{block}``: evictable cached blocks that a prefix hit reused since they were cached."""
EVICTION_AGE: Final = "vllm.kv_cache.eviction.age"
"""Observable counter, ``s``: summed age (time since it was cached) of every evicted block;
divided by ``vllm.kv_cache.evictions``, the mean age at eviction."""
EVICTION_AGE_MAX: Final = "vllm.kv_cache.eviction.age.max"
"""Observable gauge, ``s``: the oldest block evicted since the previous collection."""
COMPUTED_TOKENS: Final = "vllm.kv_cache.computed_tokens"
"""Observable counter, ``{token}``: tokens finished requests computed, recomputations included."""

# --- KV connectors' holds and failures ------------------------------------------

CONNECTOR_HELD_BLOCKS: Final = "vllm.kv_cache.connector.held_blocks"
"""Observable gauge, ``{block}``: blocks of finished requests a KV connector still holds for a transfer."""
CONNECTOR_HELD_REQUESTS: Final = "vllm.kv_cache.connector.held_requests"
"""Observable gauge, ``{request}``: finished requests whose blocks a KV connector still holds."""
CONNECTOR_HELD_AGE_MAX: Final = "vllm.kv_cache.connector.held_age.max"
"""Observable gauge, ``s``: how long the oldest of them has been held since it finished."""
CONNECTOR_LOAD_FAILURES: Final = "vllm.kv_cache.connector.load_failures"
"""Observable counter, ``{block}``: blocks whose load through the KV connector failed."""

# --- The offload tier (a KV connector's tier in host memory: OffloadingConnector) -----
# Its unit is vLLM's offload chunk, ``blocks_per_chunk`` GPU blocks (one by default),
# called a block of the tier here.

OFFLOAD_HIT_TOKENS: Final = "vllm.kv_cache.offload.hit_tokens"
"""Span attribute: prompt tokens loaded from the offload tier, summed over admissions."""
OFFLOAD_STORED_BLOCKS: Final = "vllm.kv_cache.offload.stored_blocks"
"""Span attribute: the request's blocks the offload tier accepted for storing."""
OFFLOAD_LOAD_SECONDS: Final = "vllm.kv_cache.offload.load_seconds"
"""Span attribute: seconds the request waited for the offload tier's loads."""
OFFLOAD_MEDIUM: Final = "vllm.kv_cache.offload.medium"
"""Metric attribute of the tier's metrics: the medium, as vLLM names it, in lower case (``cpu``)."""
OFFLOAD_BLOCKS: Final = "vllm.kv_cache.offload.blocks"
"""Observable gauge, ``{block}``: the tier's blocks by ``vllm.kv_cache.block.state``: ``used`` (allocated,
stores in flight included) and ``free``."""
OFFLOAD_MEMORY_USAGE: Final = "vllm.kv_cache.offload.memory.usage"
"""Observable gauge, ``By``: bytes of the tier's used blocks."""
OFFLOAD_MEMORY_LIMIT: Final = "vllm.kv_cache.offload.memory.limit"
"""Observable gauge, ``By``: bytes of the tier's blocks."""
OFFLOAD_STORES: Final = "vllm.kv_cache.offload.stores"
"""Observable counter, ``{block}``: blocks the tier accepted for storing."""
OFFLOAD_LOADS: Final = "vllm.kv_cache.offload.loads"
"""Observable counter, ``{block}``: blocks loaded from the tier back into the GPU pool."""
OFFLOAD_EVICTIONS: Final = "vllm.kv_cache.offload.evictions"
"""Observable counter, ``{block}``: blocks the tier evicted to make room for stores."""
OFFLOAD_EVICTED_UNUSED: Final = "vllm.kv_cache.offload.evicted_unused"
"""Observable counter, ``{block}``: of those, the blocks never loaded back since they were stored: the
tier's waste."""
OFFLOAD_PROJECTED_HIT_RATIO: Final = "vllm.kv_cache.offload.projected_hit_ratio"
"""Observable gauge, ``1``: the share of looked-up prompt tokens the GPU pool and a tier
``OFFLOAD_SCALE`` times today's would together have served, over the last ten minutes
(``engine/tier_whatif.py``). On an engine with no tier, the scale is a multiple of the GPU pool's bytes."""
OFFLOAD_PROJECTED_SIZE: Final = "vllm.kv_cache.offload.projected_size"
"""Observable gauge, ``By``: the bytes of the tier each ``OFFLOAD_SCALE`` stands for."""
OFFLOAD_SCALE: Final = "vllm.kv_cache.offload.scale"
"""Attribute of ``OFFLOAD_PROJECTED_HIT_RATIO`` and ``OFFLOAD_PROJECTED_SIZE``: the tier's size as a multiple
of today's (0: no tier), or on an engine with no tier, of the GPU pool's bytes."""

# --- otel-kvcache's own health -----------------------------------------------------

INSTRUMENTATION_ERRORS: Final = "otel_kvcache.instrumentation.errors"
"""Counter, ``{error}``: errors inside otel-kvcache itself (vLLM kept running); for the
exporter's channel, the records each error cost."""
TELEMETRY_DROPPED: Final = "otel_kvcache.telemetry.dropped"
"""Counter, ``{record}``: finished requests' records and findings lost between the engine
and the backend, by ``otel_kvcache.stage``. Zero means "no data lost", not "no data"."""
STAGE: Final = "otel_kvcache.stage"
"""Attribute of ``otel_kvcache.telemetry.dropped``: where the records were lost."""
STAGE_PIPE: Final = "pipe"
"""The helper fell too far behind: the engine dropped a frame's records instead of buffering more."""
STAGE_HELPER_QUEUE: Final = "helper_queue"
"""Taken by the helper, not exported when its deadline after the engine's exit ran out."""
STAGE_HELPER_DIED: Final = "helper_died"
"""Handed to a helper that died before exporting them, or while none could be started."""
STAGE_EXPORT: Final = "export"
"""Refused by the collector; held through its outage past ``OTEL_KVCACHE_EXPORT_HOLD_SECONDS``,
beyond ``OTEL_KVCACHE_EXPORT_HOLD_BYTES``, or at the process's exit; or alone larger than
``OTEL_KVCACHE_EXPORT_MAX_BYTES``."""

# --- GPU and allocator views (the ``vllm_gpu`` instrumentor) --------------------

GPU_MEMORY_USAGE: Final = HW_GPU_MEMORY_USAGE
"""Observable gauge, ``By``: device memory in use, as nvidia-smi shows it (NVML)."""
GPU_MEMORY_LIMIT: Final = HW_GPU_MEMORY_LIMIT
"""Observable gauge, ``By``: device memory size."""
GPU_MEMORY_UTILIZATION: Final = HW_GPU_MEMORY_UTILIZATION
"""Observable gauge, ``1``: share of time device memory was read or written (NVML)."""
GPU_UTILIZATION: Final = HW_GPU_UTILIZATION
"""Observable gauge, ``1``: share of time a kernel ran (NVML)."""
GPU_PROCESS_MEMORY_USAGE: Final = "vllm.gpu.process.memory.usage"
"""Observable gauge, ``By``: device memory NVML attributes to this process (``process.pid``, ``hw.id``)."""
TORCH_MEMORY_ALLOCATED: Final = "vllm.torch.cuda.memory.allocated"
"""Observable gauge, ``By``: bytes in live tensors (torch caching allocator)."""
TORCH_MEMORY_RESERVED: Final = "vllm.torch.cuda.memory.reserved"
"""Observable gauge, ``By``: bytes the caching allocator holds from the driver."""
TORCH_MEMORY_GAP: Final = "vllm.torch.cuda.memory.unallocated"
"""Observable gauge, ``By``: reserved minus allocated: cached by torch, in use by nothing."""
TORCH_ALLOC_RETRIES: Final = "vllm.torch.cuda.alloc_retries"
"""Observable counter, ``{retry}``: cudaMalloc retries after freeing the cache."""
TORCH_OOMS: Final = "vllm.torch.cuda.ooms"
"""Observable counter, ``{oom}``: out-of-memory errors the allocator raised."""

HW_ID_ATTRIBUTE: Final = HW_ID
HW_NAME_ATTRIBUTE: Final = HW_NAME
HW_TYPE_ATTRIBUTE: Final = HW_TYPE
HW_VENDOR_ATTRIBUTE: Final = HW_VENDOR
HW_TYPE_GPU: Final = "gpu"
HW_VENDOR_NVIDIA: Final = "NVIDIA"
PROCESS_PID_ATTRIBUTE: Final = "process.pid"
TORCH_DEVICE: Final = "vllm.torch.cuda.device"
"""Metric attribute of the allocator metrics: the CUDA device index in that process."""

# --- otel-kvcache top: the live snapshot each engine publishes (docs/top.md) ---------

LIVE_STATE_RUNNING: Final = "running"
LIVE_STATE_PREEMPTED: Final = "preempted"
LIVE_STATE_WAITING: Final = "waiting"
"""Queued for its first admission (it holds blocks only while its prompt is being loaded)."""
LIVE_STATE_WAITING_FOR_REMOTE_KV: Final = "waiting for remote KV"
"""Its prompt's KV is arriving through a KV connector, into blocks it already holds."""
LIVE_STATE_HELD_FOR_SEND: Final = "held for a send"
"""Finished; a KV connector holds its blocks until a transfer to another instance is done."""
LIVE_STATE_FINISHED: Final = "finished"
"""Finished, its blocks not yet back in the pool, within the zombie grace period."""
LIVE_STATE_ZOMBIE: Final = "zombie"
"""Finished or gone, still holding blocks past the grace period (``vllm.kv_cache.zombie_requests``)."""
LIVE_STATES: Final = (
    LIVE_STATE_RUNNING,
    LIVE_STATE_PREEMPTED,
    LIVE_STATE_WAITING,
    LIVE_STATE_WAITING_FOR_REMOTE_KV,
    LIVE_STATE_HELD_FOR_SEND,
    LIVE_STATE_FINISHED,
    LIVE_STATE_ZOMBIE,
)
