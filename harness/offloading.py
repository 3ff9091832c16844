"""vLLM's OffloadingConnector with a CPU tier, its workers played as vLLM's own offloading tests play them.

The connector's scheduler side and its manager are vLLM's own, run in-process; only the
workers that would copy the blocks are played (``OffloadingWorker``).
"""

from __future__ import annotations

from typing import Any

from vllm.config import KVTransferConfig
from vllm.v1.outputs import KVConnectorOutput


def offloading(cpu_bytes: int, policy: str = "lru") -> KVTransferConfig:
    """vLLM's OffloadingConnector with its CPU tier of ``cpu_bytes``, evicting by ``policy`` (``lru``, ``arc``)."""
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes, "eviction_policy": policy},
    )


class OffloadingWorker:
    """Plays the offloading connector's workers: each step's store and load jobs (in the
    scheduler's connector metadata) complete in the next step's output, as vLLM's
    offloading tests complete them."""

    def __init__(self) -> None:
        self.jobs: dict[int, tuple[str, str]] = {}

    def take(self, scheduler_output) -> None:
        metadata = scheduler_output.kv_connector_metadata
        self.jobs.update((job_id, ("load", job.req_id)) for job_id, job in metadata.load_jobs.items())
        self.jobs.update((job_id, ("store", job.req_id)) for job_id, job in metadata.store_jobs.items())

    def output(self) -> KVConnectorOutput | None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        if not self.jobs:
            return None
        done, self.jobs = self.jobs, {}
        loaded = {request_id for kind, request_id in done.values() if kind == "load"}
        return KVConnectorOutput(
            finished_recving=loaded or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(done, 1)),
        )

    def step(self, harness: Any, **step_arguments) -> Any:
        """One step of ``harness`` (``tests/engine_harness.EngineHarness``), given the jobs of
        the step before as done; takes this step's."""
        output = harness.step(kv_connector_output=self.output(), **step_arguments)
        self.take(output)
        return output
