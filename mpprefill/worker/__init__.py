"""Forward workers: where run_batch runs (inline, a thread, or a process)."""
