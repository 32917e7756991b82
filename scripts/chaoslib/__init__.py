"""The chaos run behind scripts/chaos.py: serve and decode under load, with faults injected.

workload   seeded requests, each with the fault planned for it
hostile    malformed and hostile frames
router     the bench router plus a socket for hostile frames; files every reply
procs      what the bench's process helpers lack: a decode restart on its port, stats
run        the phases: start, load, drain, worker kill, stop
check      the verdict
"""
