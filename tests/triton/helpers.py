"""Making the four kinds of Triton client and calling them alike from async tests."""

from __future__ import annotations

import inspect

import numpy as np

FLAVOURS = ("http", "grpc", "http_aio", "grpc_aio")


def module(flavour: str):
    if flavour == "http":
        import tritonclient.http as m
    elif flavour == "grpc":
        import tritonclient.grpc as m
    elif flavour == "http_aio":
        import tritonclient.http.aio as m
    else:
        import tritonclient.grpc.aio as m
    return m


def client(flavour: str, urls: dict):
    """A plain client of ``flavour``; ``urls``: {"http": ..., "grpc": ...}."""
    return module(flavour).InferenceServerClient(urls[flavour.split("_")[0]])


def urls_of(triton) -> dict:
    return {"http": triton.http_url, "grpc": triton.grpc_url}


def tensor(flavour: str, data: np.ndarray, name: str = "x", datatype: str = "FP32"):
    t = module(flavour).InferInput(name, list(data.shape), datatype)
    t.set_data_from_numpy(data)
    return t


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value


async def close(c) -> None:
    await maybe_await(c.close())


def hexid(value: int, width: int) -> str:
    return format(value, f"0{width}x")
