"""Disaggregation: bootstrap, KV senders, transfer backends and the decode receiver."""
