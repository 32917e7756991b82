"""The HTTP front: SGLang's HTTP API in a process of its own, speaking the ZeroMQ request
protocol (mpprefill.server.protocol) to a running `mpprefill serve`."""
