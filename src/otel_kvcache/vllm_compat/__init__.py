"""Everything otel-kvcache knows about vLLM's internals, in one place.

When vLLM moves a method, this is the package to change: the hook points
(``hook_points``), the internals read without a hook (``internals``) and the readers
built on them (``readers``, ``blocks``, ``schedule_frame``), the KV connectors'
reads (``kv_transfer``), hybrid models' layouts (``layouts``), the names of vLLM's
processes (``processes``), the installed release (``versions``), and what of it all
the installed vLLM has (``survey``). What changed between the releases supported,
and what it means here, is in ``docs/vllm-versions.md``.
"""
