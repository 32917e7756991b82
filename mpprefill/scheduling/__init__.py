"""Scheduling: requests, batches, admission, the scheduler and its six loops."""
