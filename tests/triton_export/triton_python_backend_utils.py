"""A minimal double of Triton's ``triton_python_backend_utils`` (the Python backend's ``pb_utils``).

Only what parastream's model.py (pipeline/templates/model.py) calls, with the behaviour of the real
module (triton-inference-server/python_backend: src/pb_tensor.cc, src/resources/
triton_python_backend_utils.py, src/infer_response.cc):

* ``Tensor(name, numpy_array)``: a host tensor; ``as_numpy()``, ``name()``, ``is_cpu()``;
  ``to_dlpack()`` / ``__dlpack__`` / ``__dlpack_device__``.
* ``Tensor.from_dlpack(name, obj)``: takes a DLPack capsule's producer (an object with ``__dlpack__``),
  keeps the producer's memory (zero-copy) and refuses non-contiguous tensors, as the real one does.
  ``as_numpy()`` of a GPU tensor raises, as the real one does.
* ``InferenceRequest(inputs)``, ``get_input_tensor_by_name``, ``InferenceResponse(output_tensors, error)``,
  ``TritonError(message)``.
* ``Logger.log_info(message)`` (and the other levels): here the messages are kept in ``Logger.messages``.
"""

from __future__ import annotations

import numpy as np


class TritonModelException(Exception):
    pass


class TritonError:
    def __init__(self, message, code=None):
        self._message = message
        self._code = code

    def message(self):
        return self._message

    def __str__(self):
        return self._message


class Tensor:
    def __init__(self, name, numpy_array):
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        if not isinstance(numpy_array, np.ndarray):
            raise TritonModelException(f"Tensor {name!r}: expected a numpy array, got {type(numpy_array).__name__}")
        if numpy_array.dtype.type == np.str_ or numpy_array.dtype == np.void:
            raise TritonModelException("Tensor dtype used for numpy_array is not supported by Python backend.")
        self._name = name
        self._array = np.ascontiguousarray(numpy_array)
        self._device = None  # host memory

    # -- what model.py calls ------------------------------------------------------------------------
    def name(self):
        return self._name

    def is_cpu(self):
        return self._device is None

    def as_numpy(self):
        if not self.is_cpu():
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")
        return self._array

    def to_dlpack(self):
        return self.__dlpack__()

    def __dlpack__(self, stream=None):
        if isinstance(self._array, np.ndarray):
            return self._array.__dlpack__()
        import torch

        # the real Tensor (C++) exports its memory whatever the caller's current GPU; torch only from its own
        with torch.cuda.device(self._array.device):
            return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name, obj):
        if not hasattr(obj, "__dlpack__"):
            raise TritonModelException("Provided tensor is not supported. Tensor must have a `__dlpack__` attribute")
        device_type, device_id = obj.__dlpack_device__()
        t = Tensor.__new__(Tensor)
        t._name = name
        if int(device_type) == 1:  # kDLCPU
            t._array = np.from_dlpack(obj)
            t._device = None
            if not t._array.flags.c_contiguous:
                raise TritonModelException("DLPack tensor is not contiguous.")
        else:
            import torch

            with torch.cuda.device(int(device_id)):  # torch imports a capsule only on its current device
                t._array = torch.from_dlpack(obj)  # keeps the producer's device memory, no copy
            t._device = (int(device_type), int(device_id))
            if not t._array.is_contiguous():
                raise TritonModelException("DLPack tensor is not contiguous.")
        return t

    # -- for the tests --------------------------------------------------------------------------------
    @classmethod
    def on_device(cls, name, torch_tensor):
        """A GPU input, as Triton hands it over with FORCE_CPU_ONLY_INPUT_TENSORS "no"."""
        return cls.from_dlpack(name, torch_tensor)

    def data(self):
        """The tensor's storage: a numpy array, or a torch tensor for GPU memory."""
        return self._array


class InferenceRequest:
    def __init__(self, inputs, requested_output_names=()):
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)

    def inputs(self):
        return self._inputs

    def requested_output_names(self):
        return self._requested


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        if type(output_tensors) is not list:
            raise TritonModelException('"output_tensors" must be a list.')
        self._output_tensors = output_tensors
        self._error = error

    def output_tensors(self):
        return self._output_tensors

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


def get_input_tensor_by_name(inference_request, name):
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def _logs_at(level: str):
    return classmethod(lambda cls, message: cls.messages.append((level, str(message))))


class Logger:
    """The backend's logger (``pb_utils.Logger``: its messages go to the server's log); the double keeps them."""

    messages: list[tuple[str, str]] = []
    log_info, log_warn, log_error, log_verbose = (_logs_at(level) for level in ("info", "warn", "error", "verbose"))
