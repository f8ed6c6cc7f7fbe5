"""tritonclient over HTTP and gRPC, the same calls for both, and onnxruntime references (the server tier and
bench/triton_gpu.py)."""

from __future__ import annotations

import numpy as np

PROTOCOLS = ("http", "grpc")


def _module(protocol: str):
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ValueError(f"protocol {protocol!r} is not one of {PROTOCOLS}")
    return mod


def client_of(server, protocol: str):
    """A client of ``server`` (a TritonServer) with bounded timeouts; close() it."""
    mod = _module(protocol)
    if protocol == "http":
        return mod.InferenceServerClient(server.http_url, connection_timeout=60.0, network_timeout=120.0)
    return mod.InferenceServerClient(server.grpc_url)


def make_inputs(protocol: str, feeds: dict, *, shm: dict | None = None) -> list:
    """InferInputs of numpy ``feeds``, declared with their own data types; ``shm`` names the shared-memory region
    that holds a tensor (its bytes are then not sent)."""
    from tritonclient.utils import np_to_triton_dtype

    mod = _module(protocol)
    inputs = []
    for name, x in feeds.items():
        i = mod.InferInput(name, list(x.shape), np_to_triton_dtype(x.dtype))
        if shm and name in shm:
            i.set_shared_memory(shm[name], x.nbytes)
        else:
            i.set_data_from_numpy(x)
        inputs.append(i)
    return inputs


def infer(client, protocol: str, model: str, inputs: list, outputs: list[str]) -> dict:
    """One request (gRPC bounded by client_timeout, HTTP by the client's network_timeout); outputs as numpy."""
    mod = _module(protocol)
    kwargs = {"client_timeout": 120.0} if protocol == "grpc" else {}
    result = client.infer(model, inputs, outputs=[mod.InferRequestedOutput(o) for o in outputs], **kwargs)
    return {o: result.as_numpy(o) for o in outputs}


ORT_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float16)": np.float16}


def random_feeds(sess, rng: np.random.Generator, batch: int | None = None) -> dict:
    """Seeded inputs for an onnxruntime session's model (``batch`` fills a symbolic leading dimension)."""
    feeds = {}
    for i in sess.get_inputs():
        shape = [batch if not isinstance(d, int) else d for d in i.shape]
        dtype = ORT_DTYPES[i.type]
        feeds[i.name] = (rng.standard_normal(shape) if dtype in (np.float32, np.float16) else rng.integers(0, 8, shape)).astype(dtype)
    return feeds


def expected(sess, feeds: dict) -> dict:
    """onnxruntime's outputs: the reference every served answer is compared with."""
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))
