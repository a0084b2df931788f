"""What the client wrappers share: a client family (:class:`Kind`), what ``instrument()``
changed on a client (:class:`State`), how a call's tensor bytes are read, and starting and
finishing a call's stage.

Bytes (``inferprof.bytes`` and the split ``inferprof.triton.request.bytes`` /
``...response.bytes``) are the binary tensor data on the wire, read from sizes the client
already holds: no tensor is copied or serialised for them. Tensors sent as JSON or through
shared memory count zero; a figure that cannot be read (another client version) is left
out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from inferprof import semconv
from inferprof.triton._call import NetworkCall, begin
from inferprof.triton._triton_compat import grpc_input_bytes, http_input_bytes

_logger = logging.getLogger(__name__)

#: Bytes per element of Triton's fixed-size data types (``BYTES`` elements vary).
_ELEMENT_SIZE = {
    "BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2,
    "UINT32": 4, "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8,
}  # fmt: skip


# --- bytes -----------------------------------------------------------------------------------


def http_sent(inputs: Iterable) -> int:
    n = 0
    for tensor in inputs:
        data = http_input_bytes(tensor)  # the bytes the client will send, as it holds them
        if data is not None:
            n += len(data)
    return n


def grpc_sent(inputs: Iterable) -> int:
    n = 0
    for tensor in inputs:
        data = grpc_input_bytes(tensor)
        if data is not None:
            n += len(data)
    return n


def http_received(result: Any) -> int:
    n = 0
    for output in result.get_response().get("outputs", ()):
        params = output.get("parameters")
        if params:
            n += params.get("binary_data_size", 0)
    return n


def grpc_received(result: Any) -> int | None:
    response = result.get_response()
    raw = response.raw_output_contents
    outputs = response.outputs
    if len(raw) != len(outputs):  # some outputs in shared memory or typed contents
        return None
    n = 0
    for i, output in enumerate(outputs):
        size = _ELEMENT_SIZE.get(output.datatype)
        if size is None:  # BYTES: the raw content's own length (reading it copies it)
            n += len(raw[i])
            continue
        for dim in output.shape:
            size *= dim
        n += size
    return n


class Kind:
    """One client family: its protocol, how its tensors' bytes are read, what to wrap."""

    __slots__ = ("methods", "name", "protocol", "received", "sent")

    def __init__(
        self,
        name: str,
        protocol: str,
        sent: Callable[[Iterable], int],
        received: Callable[[Any], int | None],
        methods: dict[str, Callable],
    ) -> None:
        self.name = name
        self.protocol = protocol
        self.sent = sent
        self.received = received
        #: method name -> factory(the class's function, kind) -> the overriding method
        self.methods = methods


#: Where an instrumented client keeps its :class:`State` (its ``__dict__``).
STATE_KEY = "_inferprof_triton"


class State:
    """What ``instrument()`` changed on one client."""

    __slots__ = ("cls", "kind", "plugin", "propagate", "stream")

    def __init__(self, kind: Kind, cls: type, propagate: bool | str) -> None:
        self.kind = kind
        self.cls = cls  # the client's class before instrument()
        self.propagate = propagate  # True, False or PROPAGATE_SAMPLED
        self.plugin: Any = None  # the TraceContextPlugin registered on the client
        self.stream: Any = None  # the sync gRPC client's open stream (_streams._Stream)


def state_of(client: Any) -> State:
    state = vars(client).get(STATE_KEY)
    if state is None:
        # Only for a client whose __dict__ was replaced wholesale after instrument(): its
        # calls go through unrecorded by the stream and propagation logic.
        state = State(None, type(client), False)  # type: ignore[arg-type]
    return state


#: ``instrument(propagate=...)``: send the trace context only for head-sampled traces.
PROPAGATE_SAMPLED = "sampled"


def outgoing(client: Any, call: NetworkCall) -> Any:
    """The span context ``call`` sends to Triton, per the client's ``propagate`` setting."""
    context = call.context
    if context is None:
        return None
    propagate = state_of(client).propagate
    if propagate is True or (propagate == PROPAGATE_SAMPLED and context.trace_flags.sampled):
        return context
    return None


# --- a call's stage --------------------------------------------------------------


def start(kind: Kind, model_name: Any, inputs: Any, version: Any) -> NetworkCall | None:
    attrs = {
        semconv.ATTR_TRITON_MODEL_NAME: str(model_name),
        semconv.ATTR_TRITON_PROTOCOL: kind.protocol,
    }
    if version:
        attrs[semconv.ATTR_TRITON_MODEL_VERSION] = str(version)
    call = begin(attrs)
    if call is not None:
        try:
            call.add_bytes(sent=kind.sent(inputs))
        except Exception:  # a client version without the accessors: no byte count
            _logger.debug("inferprof could not count a Triton request's bytes", exc_info=True)
    return call


def finish(call: NetworkCall, kind: Kind, result: Any) -> None:
    try:
        call.add_bytes(received=kind.received(result))
    except Exception:
        _logger.debug("inferprof could not count a Triton response's bytes", exc_info=True)
    call.end()


def version(args: tuple, kwargs: dict) -> Any:
    """``model_version``: the first positional argument after the fixed ones, or a keyword."""
    return kwargs.get("model_version", args[0] if args else "")


__all__ = [
    "PROPAGATE_SAMPLED",
    "STATE_KEY",
    "Kind",
    "State",
    "finish",
    "grpc_received",
    "grpc_sent",
    "http_received",
    "http_sent",
    "outgoing",
    "start",
    "state_of",
    "version",
]
