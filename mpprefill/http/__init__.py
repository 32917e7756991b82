"""The HTTP front: SGLang's HTTP API in a process of its own, speaking the ZeroMQ request
protocol (mpprefill.protocol) to a running `mpprefill serve`."""
