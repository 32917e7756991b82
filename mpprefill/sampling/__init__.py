"""Sampling: per-request parameters (`params`, free of torch, so that the HTTP front and
the request protocol load without it), their batched tensors (`info`) and the sampler
(`sampler`)."""
