"""The prefill server: the ZeroMQ request server around the scheduler, its profiling and a
client for its request protocol (mpprefill.protocol)."""
