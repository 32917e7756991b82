"""Disaggregation. The prefill side: KV senders (sender, transfer_sender), the transfer
thread (transfer) and its backends (backends, shm_backend, mooncake_backend, planes); the
wire both sides speak (wire); the decode receiver (decode/)."""
