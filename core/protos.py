"""Protobuf messages (onnx's protos) field by field, across protobuf versions."""

from __future__ import annotations


def is_repeated(field) -> bool:
    """Whether a protobuf ``FieldDescriptor`` is repeated: ``is_repeated`` where protobuf has it, else its label
    (protobuf 7, the GPU machine's 7.36 among them, dropped ``label``)."""
    flag = getattr(field, "is_repeated", None)
    if flag is not None:
        return bool(flag)
    return field.label == field.LABEL_REPEATED
