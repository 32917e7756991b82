"""The chaos run behind scripts/chaos.py: serve and decode under load, with faults injected.

workload   seeded requests, each with the fault planned for it
hostile    malformed and hostile frames
router     the bench router plus sockets for hostile frames and the bootstrap endpoint;
           files every reply
gateway    the router leg: SGLang's router in front of serve's HTTP front and a
           generating decode server, and the requests sent through it
procs      what the bench's process helpers lack: a decode restart on its port, a decode
           server with its HTTP front, stats, leftovers
run        the phases: start, load, drain, worker kill, stop
deploy     a prefill, decodes and SGLang's router over them, each server restartable on
           its ports (the restart legs and scripts/soak.py)
restarts   the restart legs: a decode, then the prefill, SIGKILLed and restarted under load
check      the verdict
"""
