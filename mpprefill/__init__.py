"""mpprefill: the prefill side of a PD-disaggregated LLM server."""
