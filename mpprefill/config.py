"""Server configuration: one frozen dataclass; `mpprefill.flags` makes its flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mpprefill import ports
from mpprefill.devices import EMULATED, Device, Emulation
from mpprefill.flags import option
from mpprefill.layer_configs import (
    SWA_PATTERN_HELP,
    HostTierConfig,
    LinkConfig,
    ModelSource,
    PoolConfig,
    WorkerConfig,
)
from mpprefill.modes import (
    FORWARD_MODES,
    MODES,
    ForwardMode,
    check_dispatch,
    resolve_forward_mode,
)
from mpprefill.ports import Listen

TRANSFER_BACKENDS = ("shm", "mooncake", "fake")
DEVICES = ("auto", "cpu", "cuda", EMULATED)  # auto: cuda where torch sees one, else cpu
EMULATE_GPUS = ("h100", "h200", "b200")
EMULATE_ISSUES = ("model", "free")  # the emulated forward's host issue: the stand-in's, or none
MAX_LAUNCH_US = 1000.0  # a launch of a millisecond is a stall, not a driver's cost
MAX_SWITCH_INTERVAL_MS = 1000.0
DEFAULT_MAX_TOTAL_TOKENS = (
    16384  # the KV pool off CUDA, where --mem-fraction-static does not size it
)
DEFAULT_MEM_FRACTION_STATIC = 0.85
# presets; or a config.json
EMULATE_MODELS = (
    "Qwen2.5-0.5B",
    "Llama-3.1-8B",
    "Qwen2.5-14B",
    "Llama-3.1-70B",
    "Qwen3-8B",
    "Qwen3-32B",
    "Mixtral-8x7B",
    "Qwen3-30B-A3B",
    "Qwen3-235B-A22B",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "DeepSeek-V3",
)
STAGINGS = ("pinned", "cuda-ipc")  # how a CUDA worker gets its batch inputs
DTYPES = ("auto", "bfloat16", "float16", "float32")
# "auto": the best the device has (see mpprefill.model.attention)
ATTENTION_BACKENDS = ("auto", "torch_native", "torch_varlen")
LOOPBACK = "127.0.0.1"
# An RDMA write over one switch: NICs quote 1-2 us port to port; a switch hop and the
# completion's poll bring it to a few.
DEFAULT_LINK_LATENCY_US = 5.0
API_KEY_HELP = (
    "every HTTP route but /health needs `Authorization: Bearer KEY` (else 401); default"
    " $MPPREFILL_API_KEY. The HTTP front gets the key through its environment, never its"
    " command line, which ps shows to every user: prefer the variable to this flag too"
)
ZMQ_HOST_HELP = (
    "address the ZeroMQ request socket binds to (loopback whatever --host is): it takes"
    " generate, abort and flush_cache with no key from anyone who can reach it, so bind it"
    " elsewhere only on a network you trust"
)


def secret_field(help: str) -> Any:
    """A flag of no default whose value stays out of the dataclass's repr (and so out of
    log lines that print the settings)."""
    return dataclasses.field(default=None, repr=False, metadata={"help": help})


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = option(
        None, "HF-style model dir (config.json + *.safetensors); default: the built-in tiny model"
    )
    dtype: str = option(
        "auto",
        "weights and activations; auto: the checkpoint's torch_dtype (the built-in model is"
        " float32)",
        choices=DTYPES,
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV pool's dtype, which the staging, transfer, host store and decode carry;"
        " auto: the model's dtype",
        choices=DTYPES,
    )
    attention_backend: str = option(
        "auto",
        "batched attention: torch_native (padded SDPA, any device) or torch_varlen (torch's"
        " flash varlen kernel, CUDA); auto: torch_varlen on CUDA where it runs, else"
        " torch_native",
        choices=ATTENTION_BACKENDS,
    )
    forward_mode: str | None = option(
        None, "where run_batch runs and how it overlaps", choices=FORWARD_MODES
    )
    disable_overlap_schedule: bool = option(False, "use the normal loop (no overlap)")
    disaggregation_mode: str = option(
        "prefill", "PD role of this server", choices=("null", "prefill")
    )
    pp_size: int = option(1, "pipeline parallel size (only 1 is supported)")
    page_size: int = option(16, "tokens per KV page")
    chunked_prefill_size: int = option(512, "max new tokens of one request per batch (-1: off)")
    max_running_requests: int = option(64, "max requests in one prefill batch")
    max_total_tokens: int | None = option(
        None,
        "KV pool capacity in tokens; default: on CUDA, what --mem-fraction-static leaves for"
        f" it; on the CPU and the emulated device, {DEFAULT_MAX_TOTAL_TOKENS}",
    )
    mem_fraction_static: float = option(
        DEFAULT_MEM_FRACTION_STATIC,
        "fraction of the device's memory for the weights plus the KV pool (SGLang's meaning):"
        " on CUDA without --max-total-tokens the pool takes what this leaves of the free"
        " memory once the weights are counted; not used on the CPU or the emulated device",
    )
    max_prefill_tokens: int = option(4096, "max new tokens in one prefill batch")
    context_length: int | None = option(None, "max prompt length (default: the model's)")
    disaggregation_transfer_backend: str = option(
        "fake", "how KV reaches the decode side", choices=TRANSFER_BACKENDS
    )
    disaggregation_layerwise_send: bool = option(
        False,
        "send each layer's KV pages of a batch's new tokens as soon as the forward wrote that"
        " layer, while later layers compute, instead of after the whole forward (a KV pool"
        " with sliding-window layers sends whole pages)",
    )
    host: str = option(
        LOOPBACK,
        "address the HTTP front and the bootstrap endpoint bind to (the request socket:"
        " --zmq-host)",
    )
    port: int = option(
        ports.DEFAULT_PORT,
        "HTTP port: SGLang's API, served by the HTTP front process; --zmq-port and"
        " --disaggregation-bootstrap-port derive from it when not given",
    )
    zmq_port: int | None = option(
        None,
        "the ZeroMQ JSON request socket's port (the HTTP front, bench and chaos use it);"
        " default --port + 100",
    )
    zmq_host: str = option(LOOPBACK, ZMQ_HOST_HELP)
    api_key: str | None = secret_field(API_KEY_HELP)
    disable_http_front: bool = option(
        False, "serve the ZeroMQ request socket only: no HTTP front process (as the bench does)"
    )
    tokenizer_path: str | None = option(
        None, "the HTTP front's tokenizer dir, with tokenizer.json (default: --model-path)"
    )
    served_model_name: str | None = option(
        None, "the model's name in the OpenAI routes and /v1/models (default: --model-path)"
    )
    chat_template: str | None = option(
        None, "the chat template of /v1/chat/completions: a jinja file or the template itself"
    )
    skip_tokenizer_init: bool = option(
        False, "the HTTP front takes and returns token ids only (no tokenizer, no chat)"
    )
    decode_address: str | None = option(None, "decode receiver address host:port (shm/mooncake)")
    device: str = option(
        "auto",
        "device of the forward worker; auto: cuda when torch sees a GPU, else cpu; 'emulated'"
        " runs the model's code on the CPU at a tiny width and charges device time from a"
        " roofline of --emulate-model on --emulate-gpu",
        choices=DEVICES,
    )
    emulate_model: str = option(
        "Qwen2.5-0.5B",
        "with --device emulated: the model whose shapes set the device time, a preset name"
        f" ({', '.join(EMULATE_MODELS)}) or a Hugging Face config.json (file or directory)",
    )
    emulate_gpu: str = option(
        "h200",
        "with --device emulated: the GPU whose roofline sets the device time",
        choices=EMULATE_GPUS,
    )
    emulate_launch_us: float = option(
        0.0,
        "with --device emulated: driver time of one kernel launch in microseconds, spent per"
        " layer for the roofline's kernels with the GIL released, as a real launch's is (0: the"
        " host stand-in's own calls only)",
    )
    emulate_issue: str = option(
        "model",
        "with --device emulated: 'model' issues every layer of the host stand-in; 'free' runs"
        " only its embedding and head, so the forward's host issue costs next to nothing (a"
        " control: the device and the scheduler act alone)",
        choices=EMULATE_ISSUES,
    )
    switch_interval_ms: float = option(
        5.0,
        "the GIL's switch interval (sys.setswitchinterval) in the scheduler and forward"
        " processes alike, threads included; Python's default is 5 ms",
    )
    staging: str = option(
        "pinned",
        "with --device cuda, how batches reach the forward process: pinned host shared memory"
        " the worker copies in (the scheduler needs no CUDA) or cuda-ipc device slots the"
        " scheduler fills on its own copy stream",
        choices=STAGINGS,
    )
    worker_threads: int = option(
        0,
        "torch threads for the forward (0: all cores); with a forward process the scheduler"
        " process gets the cores left, at least one",
    )
    trace_dir: str | None = option(None, "write Chrome trace JSON here")
    check_invariants: bool = option(False, "assert pool/cache invariants after every drain")
    delay_sampling: bool = option(False, "sample after the forward, as a separate worker step")
    max_queued_requests: int = option(4096, "waiting requests beyond this get 'overloaded'")
    bootstrap_timeout: float = option(30.0, "seconds a request may wait for its decode side")
    forward_timeout: float = option(
        300.0,
        "seconds a forward (or its deferred sample) may take before its requests fail and the"
        " worker is treated as dead; not enforced on the inline worker (normal, overlap)",
        aliases=("--watchdog-timeout",),
    )
    transfer_timeout: float = option(
        300.0, "seconds a request's KV may take from its first page sent to the decode's ack"
    )
    emulate_link_gbps: float | None = option(
        None,
        "emulate the network link the KV transfer takes (shm and mooncake): this many Gb/s,"
        " one message (a page write, a room's completion) after another; a room's completion"
        " reaches the decode only once its last byte would have (default: no emulation)",
    )
    emulate_link_latency_us: float = option(
        DEFAULT_LINK_LATENCY_US,
        "with --emulate-link-gbps: each message's one-way latency in microseconds, overlapping"
        " between messages (default: an RDMA write's few microseconds)",
    )
    random_seed: int = option(0, "seed of the built-in model's weights")
    record_batches: str | None = option(None, "on exit, write every batch's shape (JSON) here")
    log_level: str = option("info", "logging level")
    disable_gc_freeze: bool = option(
        False,
        "leave the heap to the cyclic GC; by default the scheduler and forward processes"
        " freeze what is alive once started (gc.freeze), so a full collection skips it",
    )
    disable_radix_cache: bool = option(False, "no prefix cache: every prompt is computed whole")
    host_store_size: int = option(
        0, "host KV store under the device prefix cache, in tokens, LRU-evicted (0: off)"
    )
    disable_batched_writeback: bool = option(
        False,
        "copy host write-backs one request at a time instead of one gather per batch",
        aliases=("--disable-batched-staging",),
    )
    sliding_window: int | None = option(
        None, "window of the sliding-window layers (overrides the model's; see --swa-layers)"
    )
    swa_layers: str | None = option(None, SWA_PATTERN_HELP + "; default with --sliding-window: all")
    swa_full_tokens_ratio: float = option(
        0.8, "SWA KV pool size as a fraction of --max-total-tokens (sliding-window models)"
    )
    swa_free_out_of_window: bool = option(
        False,
        "free a running request's sliding-window KV once it leaves the window, instead of"
        " keeping it (evicted first) for prefix hits",
    )
    disaggregation_bootstrap_port: int | None = option(
        None,
        "port of the bootstrap endpoint where decode servers register their rooms (shm and"
        " mooncake without --decode-address; 0: any free port); default --port - 21002,"
        " SGLang's 8998 at the default --port",
    )
    tp_size: int = option(
        1,
        "tensor parallel size: that many forward processes, rank r on cuda:r (NCCL) or a CPU"
        " rank (gloo), sharding the model Megatron-style; needs --forward-mode proc or"
        " proc-ahead. With --device emulated, one process charges one GPU's time of the"
        " group: its shard's roofline plus the all-reduces over NVLink",
    )

    def __post_init__(self):
        # NOTE: the one place `auto` and the CPU's pool default resolve, so every copy
        # (dataclasses.replace, the forward process's rebuild) holds concrete values.
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.max_total_tokens is None and not self.worker_device.on_cuda:
            object.__setattr__(self, "max_total_tokens", DEFAULT_MAX_TOTAL_TOKENS)
        # NOTE: the environment's aliases are read here, once; copies keep the name.
        mode = resolve_forward_mode(self.forward_mode, self.disable_overlap_schedule)
        object.__setattr__(self, "forward_mode", mode)
        self._check()

    def _check(self) -> None:
        if not self.forward_timeout > 0:
            raise ValueError(f"--forward-timeout must be positive, got {self.forward_timeout}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        self._check_mode()
        self._check_sizes()
        self._check_host_store()
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend: one of {TRANSFER_BACKENDS}")
        if min(self.bootstrap_timeout, self.transfer_timeout) <= 0:
            raise ValueError("--bootstrap-timeout and --transfer-timeout must be positive")
        self._check_choices()
        self.link_config()  # raises on a bad link
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")
        self._check_ports()
        if self.tp_size > 1:
            self._check_tp()

    def _check_sizes(self) -> None:
        """Pages, chunks, batch limits and the pool's share of memory."""
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"--page-size must be a power of two >= 1, got {self.page_size}")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be -1 or >= --page-size")
        for name in ("max_running_requests", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"--sliding-window must be positive, got {self.sliding_window}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError("--swa-full-tokens-ratio must be in (0, 1]")

    def _check_host_store(self) -> None:
        if self.host_store_size < 0:
            raise ValueError("--host-store-size must be >= 0 (0: off)")
        if self.host_store_size and self.disable_radix_cache:
            raise ValueError("--host-store-size needs the prefix cache (--disable-radix-cache)")
        if 0 < self.host_store_size < self.page_size:
            raise ValueError("--host-store-size must be 0 or hold at least one page")

    def _check_choices(self) -> None:
        """The device, the emulation's settings, dtypes and backends: each one of its set."""
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"--device: one of {DEVICES}, got {self.device!r}")
        if self.emulate_gpu not in EMULATE_GPUS:
            raise ValueError(f"--emulate-gpu: one of {EMULATE_GPUS}")
        if self.emulate_issue not in EMULATE_ISSUES:
            raise ValueError(f"--emulate-issue: one of {EMULATE_ISSUES}")
        if not 0 <= self.emulate_launch_us <= MAX_LAUNCH_US:
            raise ValueError(f"--emulate-launch-us must be in [0, {MAX_LAUNCH_US}]")
        if not 0 < self.switch_interval_ms <= MAX_SWITCH_INTERVAL_MS:
            raise ValueError(f"--switch-interval-ms must be in (0, {MAX_SWITCH_INTERVAL_MS}]")
        for name, value, allowed in (
            ("dtype", self.dtype, DTYPES),
            ("kv-cache-dtype", self.kv_cache_dtype, DTYPES),
            ("attention-backend", self.attention_backend, ATTENTION_BACKENDS),
            ("staging", self.staging, STAGINGS),
        ):
            if value not in allowed:
                raise ValueError(f"--{name}: one of {allowed}, got {value!r}")

    def _check_mode(self) -> None:
        check_dispatch(self.mode, self.disaggregation_mode, self.pp_size)
        emulated = self.worker_device.emulated  # one process models the group's device
        if self.tp_size > 1 and not emulated and not self.mode.in_process:
            raise ValueError(
                f"--tp-size {self.tp_size} needs a forward process group: --forward-mode proc"
                f" or proc-ahead, not {self.forward_mode}"
            )

    def _check_ports(self) -> None:
        listens = [Listen("--port", self.port), self.zmq_listen]
        if self.serves_bootstrap:
            listens.append(self.bootstrap_listen)
        for listen in listens:
            ports.check_range(listen)
        if not self.disable_http_front and self.port == self.zmq_listen.port:
            raise ValueError(f"--port and --zmq-port are both {self.port}")

    def _check_tp(self) -> None:
        """What a tensor-parallel group does not run (yet)."""
        if self.staging == "cuda-ipc":
            raise ValueError("--tp-size > 1 needs --staging pinned")
        if self.host_store_size:
            raise ValueError("--tp-size > 1 does not run with --host-store-size (yet)")

    def context_len(self, max_position_embeddings: int) -> int:
        """The longest prompt this server takes: --context-length, else the model's positions.
        Admission validates against it and the staging slots are sized from it."""
        return self.context_length or max_position_embeddings

    @property
    def http_listen(self) -> Listen | None:
        """The HTTP front's port; None with --disable-http-front."""
        return None if self.disable_http_front else Listen("--port", self.port)

    @property
    def zmq_listen(self) -> Listen:
        return ports.derive("--zmq-port", self.zmq_port, self.port, ports.ZMQ_OFFSET)

    @property
    def bootstrap_listen(self) -> Listen:
        flag, given = "--disaggregation-bootstrap-port", self.disaggregation_bootstrap_port
        return ports.derive(flag, given, self.port, ports.BOOTSTRAP_OFFSET)

    @property
    def serves_bootstrap(self) -> bool:
        """Decode servers register rooms here: KV moves, to no fixed --decode-address."""
        return self.disaggregation_transfer_backend != "fake" and self.decode_address is None

    @property
    def listens(self) -> list[Listen]:
        """Every port this server listens on: the HTTP front's, the request socket's, the
        bootstrap endpoint's (where it has them)."""
        out = [self.zmq_listen]
        if self.http_listen is not None:
            out.insert(0, self.http_listen)
        if self.serves_bootstrap:
            out.append(self.bootstrap_listen)
        return out

    @property
    def binds(self) -> list[tuple[str, Listen]]:
        """Each port of `listens` with the host it binds: --zmq-host for the request socket,
        --host for the others."""
        zmq = self.zmq_listen
        return [(self.zmq_host if listen == zmq else self.host, listen) for listen in self.listens]

    @property
    def worker_device(self) -> Device:
        """The forward's device: the one place --device's name is read."""
        if self.device != EMULATED:
            return Device(self.device)
        emulation = Emulation(
            self.emulate_model,
            self.emulate_gpu,
            self.tp_size,
            self.emulate_launch_us,
            self.emulate_issue,
            self.dtype,
            self.kv_cache_dtype,
        )
        return Device("cpu", emulation)

    def model_source(self) -> ModelSource:
        return ModelSource(
            self.model_path, self.dtype, self.sliding_window, self.swa_layers, self.random_seed
        )

    def pool_config(self) -> PoolConfig:
        return PoolConfig(
            page_size=self.page_size,
            max_total_tokens=self.max_total_tokens,
            swa_full_tokens_ratio=self.swa_full_tokens_ratio,
            chunked_prefill_size=self.chunked_prefill_size,
            disable_radix_cache=self.disable_radix_cache,
            swa_free_out_of_window=self.swa_free_out_of_window,
        )

    def host_tier_config(self) -> HostTierConfig:
        return HostTierConfig(
            size=self.host_store_size,
            page_size=self.page_size,
            device=self.worker_device,
            batched_writeback=not self.disable_batched_writeback,
        )

    def link_config(self) -> LinkConfig | None:
        """The emulated network link of the KV transfer; None without --emulate-link-gbps."""
        if self.emulate_link_gbps is None:
            return None
        return LinkConfig(self.emulate_link_gbps, self.emulate_link_latency_us)

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            model=self.model_source(),
            pools=self.pool_config(),
            device=self.worker_device,
            kv_cache_dtype=self.kv_cache_dtype,
            attention_backend=self.attention_backend,
            staging=self.staging,
            tp_size=self.tp_size,
            worker_threads=self.worker_threads,
            switch_interval_ms=self.switch_interval_ms,
            forward_timeout=self.forward_timeout,
            max_running_requests=self.max_running_requests,
            max_prefill_tokens=self.max_prefill_tokens,
            context_length=self.context_length,
            mem_fraction_static=self.mem_fraction_static,
            trace_dir=self.trace_dir,
            disable_gc_freeze=self.disable_gc_freeze,
            log_level=self.log_level,
            publish_layers=self.disaggregation_layerwise_send,
        )

    @property
    def mode(self) -> ForwardMode:
        """The forward mode's entry (`forward_mode` is its name, resolved at construction)."""
        return MODES[self.forward_mode]

    def replace(self, **kw) -> ServerArgs:
        return dataclasses.replace(self, **kw)


def resolve_device(device: str, cuda_available: bool | None = None) -> str:
    """--device with `auto` made concrete: cuda when `cuda_available` (None: ask torch),
    else cpu; any other name as given."""
    if device != "auto":
        return device
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    return "cuda" if cuda_available else "cpu"


def kv_pool_tokens(
    free: int, total: int, weights: int, per_token: int, fraction: float, page_size: int
) -> int:
    """Tokens of a KV pool sized as SGLang's --mem-fraction-static sizes it, whole pages.

    The weights and the pool together may take `fraction` of the device's `total` bytes,
    less what others hold already (`total - free`); the weights (`weights` bytes, not yet
    loaded) come off that, and the pool takes the rest at `per_token` bytes a token:

        pool = fraction * total - (total - free) - weights
    """
    budget = fraction * total - (total - free) - weights
    tokens = int(budget // per_token) // page_size * page_size if budget > 0 else 0
    if tokens < page_size:
        raise ValueError(
            f"--mem-fraction-static {fraction} leaves no KV pool: {free / 2**30:.2f} of"
            f" {total / 2**30:.2f} GiB free, the weights take {weights / 2**30:.2f} GiB;"
            " raise it or give --max-total-tokens"
        )
    return tokens
