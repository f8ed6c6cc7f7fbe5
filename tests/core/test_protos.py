"""Which protobuf fields are repeated, on descriptors with and without ``label``."""

import types

import onnx

from parastream.core.protos import is_repeated


def test_repeated_fields_are_known_on_this_protobuf():
    fields = onnx.GraphProto.DESCRIPTOR.fields_by_name
    assert is_repeated(fields["node"]) and is_repeated(fields["initializer"])
    assert not is_repeated(fields["name"])


def test_a_descriptor_without_label_is_read_by_is_repeated_and_an_old_one_by_its_label():
    """protobuf 7 (and the GPU machine's upb descriptors) have ``is_repeated`` and no ``label``; older ones only
    the label (the structure key of every torch branch failed on the first kind with AttributeError)."""
    new = types.SimpleNamespace(is_repeated=True)
    assert is_repeated(new) and not is_repeated(types.SimpleNamespace(is_repeated=False))
    old = types.SimpleNamespace(label=3, LABEL_REPEATED=3)
    assert is_repeated(old) and not is_repeated(types.SimpleNamespace(label=1, LABEL_REPEATED=3))


def test_the_structure_key_copies_fields_on_a_descriptor_without_label(monkeypatch):
    """``structure_key`` walks a branch's fields: with descriptors that have no ``label`` it gives the same key."""
    from onnx import TensorProto, helper

    from parastream.launcher.engines import torch as tb

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    m = helper.make_model(g)
    before = tb.structure_key(m, [])

    class NoLabel:
        def __init__(self, fd):
            self._fd = fd

        def __getattr__(self, name):
            if name == "label":
                raise AttributeError("'FieldDescriptor' object has no attribute 'label'")
            return getattr(self._fd, name)

        @property
        def is_repeated(self):
            return self._fd.label == self._fd.LABEL_REPEATED

    real = tb._copy_fields

    def copy_without_label(dst, src, skip):
        desc = types.SimpleNamespace(fields=[NoLabel(fd) for fd in src.DESCRIPTOR.fields])
        proxy = types.SimpleNamespace(DESCRIPTOR=desc, HasField=src.HasField,
                                      **{fd.name: getattr(src, fd.name) for fd in src.DESCRIPTOR.fields})
        return real(dst, proxy, skip)

    monkeypatch.setattr(tb, "_copy_fields", copy_without_label)
    assert tb.structure_key(m, []) == before
