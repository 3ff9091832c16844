"""The names vLLM gives the processes it starts, and the role each name stands for."""

from __future__ import annotations

from otel_kvcache import names

# The names vLLM gives the processes it starts -> (role, attribute for the number in the name).
PROCESS_ROLES = (
    (r"EngineCore(?:_DP(\d+))?", names.ROLE_ENGINE_CORE, names.ENGINE_INDEX),
    (r"VllmWorker-(\d+)", names.ROLE_WORKER, names.WORKER_RANK),
    # --data-parallel-size > 1: the coordinator; --api-server-count > 1: the API servers
    # (vllm/v1/engine/coordinator.py and vllm/v1/utils.py, 0.30 to 0.34).
    (r"VLLM_DP_Coordinator", names.ROLE_DP_COORDINATOR, None),
    (r"ApiServer_(\d+)", names.ROLE_API_SERVER, names.API_SERVER_INDEX),
)
