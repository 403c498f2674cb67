"""Wire types between clients and engine cores: msgspec structs, never pickle.

Every struct here crosses a ZMQ socket. They are `array_like` (encoded as msgpack arrays, so
field order is the format) and `omit_defaults`; new fields are only ever appended, with
defaults, so an older peer still decodes a newer frame. Framing (one-byte request types,
out-of-band tensor frames) is described in `shoal.engine.serial` and `shoal.engine.core.core_proc`.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

from shoal.engine.errors import RequestError

# Bumped when a frame layout changes incompatibly; HELLO carries it and the engine refuses a
# client that speaks another version.
PROTOCOL_VERSION = 2

# Utility call id reserved for engine-initiated notifications (elastic EP events). A frame with
# this call id is an event for the client's notification handler, never a reply to a call.
EEP_NOTIFICATION_CALL_ID = -1

# First frame of the message an engine pushes to every attached client just before it exits on
# a fatal error. The second frame is the engine index as ASCII digits.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class EngineCoreRequestType(enum.Enum):
    """One-byte frame that precedes every client → engine payload."""

    ADD = b"\x00"
    ABORT = b"\x01"
    # b"\x02" is not used: DP waves start through the ranks' own store (`engine/parallel/dp_wave.py`).
    UTILITY = b"\x03"
    HELLO = b"\x04"
    GOODBYE = b"\x05"


class FinishReason(enum.IntEnum):
    """Why a request ended. Encoded as an int on the wire."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # aborted by its client (cancel, disconnect, death)
    ERROR = 3  # rejected or failed; EngineCoreOutput.error_message says why

    def __str__(self) -> str:
        return self.name.lower()


class RequestOutputKind(enum.IntEnum):
    """What each streamed `RequestOutput` carries (client-side only)."""

    CUMULATIVE = 0  # all tokens and text so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


_GREEDY_EPSILON = 1e-5
# Every integer on the wire fits a signed 64-bit value (msgpack's and the sampler's range).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_finite_and_in_range(params: SamplingParams) -> None:
    """Refuses inf/nan floats and integers outside 64 bits (which no peer can encode).

    Raises:
        RequestError: naming the field.
    """
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number, got {value}")
    for name in _INT_FIELDS:
        value = getattr(params, name)
        if value is not None and not _INT64_MIN <= value <= _INT64_MAX:
            raise RequestError(f"{name} must fit in 64 bits, got {value}")
    if any(not _INT64_MIN <= t <= _INT64_MAX for t in params.stop_token_ids):
        raise RequestError("stop_token_ids must fit in 64 bits")


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
)
_INT_FIELDS = ("max_tokens", "top_k", "seed", "min_tokens", "logprobs")


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constraint on a request's output; names follow vLLM's `StructuredOutputsParams`.

    Exactly one kind is set. The engine compiles it into a grammar over the model's vocabulary
    (`shoal.engine.structured_output`) and masks every sampling step with it; a constraint
    that does not compile fails that request alone, with the compiler's message.

    Raises:
        ValueError: no kind, or more than one, is set (msgspec.ValidationError when decoded).
    """

    json: str | dict[str, Any] | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)
    json_object: bool = False  # any JSON object
    # JSON: allow whitespace between tokens (the compact form is the default).
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        kinds = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            found = ", ".join(kinds) or "none"
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar or "
                f"json_object; got {found}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must not be empty")


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How to sample one request; names and defaults follow vLLM's `SamplingParams`.

    Validation runs on construction and again when a peer's frame is decoded, so an invalid
    value never reaches the scheduler.

    Raises:
        ValueError: on construction with an out-of-range value (msgspec.ValidationError when
            decoded from the wire).
    """

    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 or -1 disables
    seed: int | None = None  # per-request generator; same seed, same tokens
    min_tokens: int = 0  # EOS and stop_token_ids are masked before this many tokens
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0  # subtracted from every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # >1 discourages prompt and output tokens (HF's rule)
    min_p: float = 0.0  # drops tokens less likely than min_p x the likeliest, after temperature
    # Sequences to return for the prompt. The client fans a request with n > 1 out to n engine
    # requests (`shoal.client.api.fan_out`); an engine only ever sees n == 1.
    n: int = 1
    # Constrains the output to a JSON schema, regex, choice or grammar, masked on the engine.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_finite_and_in_range(self)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}"
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0 or self.repetition_penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.structured_outputs is not None:
            self.structured_outputs.__post_init__()  # a decoded frame's, checked again

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How to pool one request on a pooling engine (`--runner pooling`); names follow vLLM's
    `PoolingParams`. The pooling type is the engine's (`--pooler-config`).

    Attributes:
        use_activation: L2-normalise the pooled vector; None: the engine's `--pooler-config`.
    """

    use_activation: bool | None = None


# The sampling parameters a pooling request carries: one output, when it finishes.
POOLING_OUTPUT = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """A LoRA adapter a request runs with, as vLLM's `LoRARequest` names it.

    Attributes:
        lora_name: the adapter's served name (the OpenAI `model` that selects it).
        lora_int_id: a positive id, unique per adapter (kept for vLLM's API; shoal keys an
            adapter by name and path).
        lora_path: the PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), on
            the engines' nodes.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """ADD payload: one tokenized request.

    A request with `pooling_params` is a pooling request: a pooling engine prefills its
    prompt and answers with the pooled final hidden state (`EngineCoreOutput.pooled`) instead
    of sampling; `sampling_params` then only carries its output kind. An engine refuses the
    kind it does not run.

    `client_index` is overwritten by the engine with the index bound to the sending
    connection at HELLO, so a client can never route outputs to another client.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    client_index: int = 0
    data_parallel_rank: int | None = None  # explicit rank pin, honoured by the DP LB client
    # The DP wave the client last saw published; an older one than the rank's marks a request
    # that raced the end of a wave (counted; the request starts the next wave either way).
    current_wave: int = 0
    # Tokens this request already generated on another rank (one that left the cluster in an
    # elastic scale-down). The engine computes prompt + these, counts them as output already
    # produced (max_tokens, min_tokens, penalties, seeded draws) and emits only the tokens
    # after them.
    resumed_output_token_ids: list[int] = msgspec.field(default_factory=list)
    pooling_params: PoolingParams | None = None  # set: pool instead of sampling
    # vLLM's request priority, lower first: orders the waiting queue (and picks whom to
    # preempt) under `--scheduling-policy priority`; ignored under fcfs.
    priority: int = 0
    # The LoRA adapter to run with (an engine started with enable_lora); None: the base model.
    lora_request: LoRARequest | None = None


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs at one generated position: the sampled token first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # rank of the sampled token in the full distribution (1 = argmax)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error_message: str | None = None  # set with FinishReason.ERROR
    # With a request's first token: seconds it waited in the engine before first scheduled.
    queue_time_s: float | None = None
    # A pooling request's answer, with its finish: the pooled final hidden state.
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# Upper bounds of the tokens-per-step buckets (vLLM's `vllm:iteration_tokens_total`).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Load snapshot of one engine; the DP coordinator publishes a vector of these.

    Counters (`*_total`) are cumulative since the engine started; the rest are gauges.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Prompt (and resumed output) tokens not yet computed, waiting + running.
    num_pending_prefill_tokens: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    step_counter: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens found
    num_preemptions_total: int = 0
    num_prompt_tokens_total: int = 0  # prompt tokens computed (recompute included)
    num_generation_tokens_total: int = 0
    num_cached_blocks: int = 0  # blocks in the prefix cache (owned or evictable)
    # Steps by the tokens they computed: [i] counts those of at most ITERATION_TOKENS_BUCKETS[i]
    # tokens (and more than the bound before), the last those over every bound; and the sum.
    iteration_tokens_counts: list[int] = msgspec.field(default_factory=list)
    iteration_tokens_sum: int = 0
    # LoRA (an engine with enable_lora): the adapters in the rank's live slots, least recently
    # used first; those its running and its waiting requests run with; adapters put in a slot
    # since the start; its slots (max_loras).
    lora_live: list[str] = msgspec.field(default_factory=list)
    lora_running: list[str] = msgspec.field(default_factory=list)
    lora_waiting: list[str] = msgspec.field(default_factory=list)
    num_lora_loads_total: int = 0
    max_loras: int = 0
    lora_cached: list[str] = msgspec.field(default_factory=list)  # kept in CPU memory
    # Adapters a load pushed out of a slot, and the seconds loads took (reading a folder or
    # copying a CPU-kept adapter into its slot), since the start.
    num_lora_evictions_total: int = 0
    lora_load_seconds_total: float = 0.0


class KVCacheEvents(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One turn's prefix-cache changes of an engine, for the clients' routing indexes.

    Keys are the 64-bit routing keys of chained block hashes (`shoal.engine.block_hash`).
    Batches are numbered 1, 2, ... per engine incarnation; the protocol (gaps, overflow,
    snapshots) is described in `shoal.engine.kv_events` and `shoal.client.routing.kv_index`.
    """

    seq: int
    stored: list[int] = msgspec.field(default_factory=list)  # blocks that entered the cache
    removed: list[int] = msgspec.field(default_factory=list)  # blocks that left it
    # Too many changes for one batch: no keys, and every client must take a snapshot.
    is_overflow: bool = False


class KVCacheSnapshot(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An engine's whole prefix cache as routing keys, as of KV-events batch `seq`."""

    seq: int
    block_keys: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0


class UtilityResult(msgspec.Struct, array_like=True, gc=False):
    """Wraps a utility method's return value so that `None` is a result, not an absence."""

    result: Any


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Reply to a UTILITY call (or an EEP notification when call_id is reserved)."""

    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One frame engine → client: outputs of one step for one client, and/or a utility reply."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    # Never set: DP waves are reported to the coordinator (`EngineStatsReport`). Kept so the
    # fields after them keep their positions on the wire.
    wave_complete: int | None = None
    start_wave: int | None = None
    # ADDs of this client the engine had taken in when `scheduler_stats` was measured: lets the
    # client tell which of its sends those stats already include.
    requests_seen: int = 0
    # The engine's prefix-cache changes since the previous batch (`shoal.engine.kv_events`).
    kv_events: KVCacheEvents | None = None


class EngineHello(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """HELLO payload: a client attaches and tells the engine where to push its outputs.

    The engine answers on the new PUSH connection with `UtilityOutput(call_id,
    result=EngineFacts)`, or a failure message if it refuses the client.
    """

    client_index: int
    output_address: str
    call_id: int
    protocol_version: int = PROTOCOL_VERSION
    # Send this client the engine's KV events (`shoal.engine.kv_events`), for routing by cache.
    wants_kv_events: bool = False


class EngineFacts(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a client learns about an engine at HELLO."""

    engine_index: int
    identity: bytes
    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    data_parallel_size: int = 1
    protocol_version: int = PROTOCOL_VERSION
    # Which attach of this engine this answer concludes (1, 2, ...): the engine's stats reports
    # say how many attaches they reflect, so a client can tell a report that predates its
    # attach from one that no longer counts it (see `EngineStatsReport`).
    attach_serial: int = 0
    # Whether its prefix cache is on: a client indexes the caches of those that have one.
    enable_prefix_caching: bool = True
    # Its driver worker's device type ("cpu", "cuda"); empty from an engine that predates it.
    device: str = ""
    # The engine that schedules and runs the model in this rank: "shoal" or "vllm".
    engine: str = "shoal"


class EngineEndpoint(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where a client reaches one engine: its bound input address and ROUTER identity."""

    engine_index: int
    identity: bytes
    input_address: str
    # The engine's CURVE public key (Z85); empty: the engine's sockets are open.
    public_key: bytes = b""


class EngineStatsReport(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What an engine pushes to its stats address: its load, when it changes (and each second)."""

    engine_index: int
    stats: SchedulerStats
    timestamp: float = 0.0
    # client index → ADDs of that client the engine had taken in when `stats` was measured.
    requests_seen: dict[int, int] = msgspec.field(default_factory=dict)
    # The engine's ROUTER identity: a restarted rank has a new one, so a client can tell the
    # last report of a dead incarnation (which the coordinator may still hold) from the
    # reports of the engine it is attached to.
    identity: bytes = b""
    # The clients attached when `stats` was measured, and how many attaches (in the order of
    # their `EngineFacts.attach_serial`) the engine had processed by then. A client whose
    # serial is covered but whose index is missing has been detached: the engine took it for
    # gone (it was paused or cut off too long) and dropped its requests.
    attached_clients: list[int] = msgspec.field(default_factory=list)
    attaches_seen: int = 0
    # DP waves of an expert-parallel rank (`shoal.engine.parallel.dp_wave`): the wave it is in or
    # paused before, whether that wave runs, and the dummy forwards it has run so far.
    current_wave: int = 0
    is_wave_running: bool = False
    num_dummy_steps: int = 0


class DPStatsSnapshot(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the DP coordinator publishes: the latest report of every rank it knows.

    `seq` increases with every publish; a heartbeat repeats unchanged reports with a new seq.
    """

    seq: int
    reports: list[EngineStatsReport] = msgspec.field(default_factory=list)
    # Expert-parallel clusters: the highest wave any rank reports, and whether any rank is
    # stepping in a wave (False: the ranks are paused).
    current_wave: int = 0
    engines_running: bool = False
