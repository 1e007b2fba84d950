"""OpenAI-compatible HTTP server: `python -m vllm_spec.entrypoints.openai.api_server MODEL` or `vllm-spec serve MODEL`."""
