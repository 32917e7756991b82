"""The host tier: a host-memory KV store under the device prefix cache."""
