"""The main job: an instrumented vLLM server on a tiny local model, under a realistic load."""
