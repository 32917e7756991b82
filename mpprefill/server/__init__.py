"""The front: the ZeroMQ request server around the scheduler, its wire protocol and a
client for it."""
