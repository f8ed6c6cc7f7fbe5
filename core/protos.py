"""Protobuf messages (onnx's protos) field by field, across protobuf versions."""

from __future__ import annotations


def is_repeated(field) -> bool:
    """Whether a protobuf ``FieldDescriptor`` is repeated: ``is_repeated`` where protobuf has it, else its label
    (protobuf 7, the GPU machine's 7.36 among them, dropped ``label``)."""
    flag = getattr(field, "is_repeated", None)
    if flag is not None:
        return bool(flag)
    return field.label == field.LABEL_REPEATED


def copy_fields(dst, src, skip: set[str]) -> None:
    """The fields ``src`` has set copied into ``dst`` (a message of its type), but those named in ``skip``, which
    are not read (``ListFields`` would hand out a weight's bytes as a copy; the torch backend's structure key
    copies a branch without its weights so)."""
    for fd in src.DESCRIPTOR.fields:
        if fd.name in skip:
            continue
        if is_repeated(fd):
            if len(getattr(src, fd.name)):
                getattr(dst, fd.name).extend(getattr(src, fd.name))
        elif src.HasField(fd.name):
            if fd.message_type is not None:
                getattr(dst, fd.name).CopyFrom(getattr(src, fd.name))
            else:
                setattr(dst, fd.name, getattr(src, fd.name))
