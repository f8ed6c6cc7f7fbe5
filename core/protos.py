"""Protobuf messages (onnx's protos) field by field, across protobuf versions."""

from __future__ import annotations


def is_repeated(field) -> bool:
    """Whether a protobuf ``FieldDescriptor`` is repeated: ``is_repeated`` where protobuf has it (protobuf 7
    dropped ``label``, and the upb descriptors of the GPU machine's protobuf have none), else its label."""
    flag = getattr(field, "is_repeated", None)
    if flag is not None:
        return bool(flag)
    return field.label == field.LABEL_REPEATED
