"""``instrument()`` / ``uninstrument()`` themselves: what they accept, what they change on a
client and what they leave alone."""

from __future__ import annotations

import gc
import weakref

import pytest

import inferprof.triton
from tests.triton.helpers import FLAVOURS, client, close, module

NOWHERE = {"http": "127.0.0.1:9", "grpc": "127.0.0.1:9"}  # never connected to


@pytest.mark.parametrize("flavour", FLAVOURS)
async def test_instrument_keeps_the_class_identity_and_undoes_cleanly(flavour):
    cls = module(flavour).InferenceServerClient
    c = client(flavour, NOWHERE)
    other = client(flavour, NOWHERE)
    try:
        assert inferprof.triton.instrument(c) is c
        assert isinstance(c, cls) and type(c) is not cls
        assert inferprof.triton.is_instrumented(c)
        assert type(c).infer is not cls.infer
        # another client of the same class is untouched
        assert type(other) is cls and not inferprof.triton.is_instrumented(other)
        plugin = c.plugin()
        assert plugin is not None
        assert inferprof.triton.instrument(c) is c  # twice: nothing more
        assert c.plugin() is plugin
        assert inferprof.triton.uninstrument(c) is c
        assert type(c) is cls and c.plugin() is None
        assert not inferprof.triton.is_instrumented(c)
        assert inferprof.triton.uninstrument(c) is c  # nothing to undo
    finally:
        await close(c)
        await close(other)


def test_the_wrapped_methods_keep_their_names_and_signatures():
    import inspect

    import tritonclient.grpc as grpcclient

    c = inferprof.triton.instrument(grpcclient.InferenceServerClient(NOWHERE["grpc"]))
    try:
        for name in ("infer", "async_infer", "start_stream", "async_stream_infer", "stop_stream"):
            method = getattr(c, name)
            original = getattr(grpcclient.InferenceServerClient, name)
            assert method.__name__ == name and method.__doc__ == original.__doc__
            assert inspect.signature(method) == inspect.signature(original.__get__(c))
    finally:
        c.close()


@pytest.mark.parametrize("flavour", ["http", "grpc"])
def test_an_instrumented_client_is_freed_without_the_cycle_collector(flavour):
    # The clients close their connections in __del__: instrument() must not add a
    # reference cycle that would leave that to the cycle collector.
    gc.collect()
    gc.disable()
    try:
        c = inferprof.triton.instrument(client(flavour, NOWHERE))
        ref = weakref.ref(c)
        del c
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("bad", [object(), "127.0.0.1:8001", None])
def test_anything_but_a_triton_client_is_a_type_error(bad):
    with pytest.raises(TypeError, match="InferenceServerClient"):
        inferprof.triton.instrument(bad)


@pytest.mark.parametrize("bad", ["always", 1, None])
def test_a_bad_propagate_setting_is_a_value_error(bad):
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(NOWHERE["grpc"])
    try:
        with pytest.raises(ValueError, match="propagate"):
            inferprof.triton.instrument(c, propagate=bad)
        assert not inferprof.triton.is_instrumented(c)
    finally:
        c.close()
