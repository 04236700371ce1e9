"""Protobuf writer schemas as the schema registry gives them, read without Spark.

Shared by the spec (columns derived from a subject's latest schema) and the raw parse
(``backfill_assets.lake.decode.protobuf``): a registry answer is a base64 ``FileDescriptorProto``
(``format=serialized``) or ``.proto`` text (what Java producers register, and what a registry
that ignores the format returns), which protoc from the grpcio-tools wheel compiles in this
process. The one import read is the well-known ``google/protobuf/timestamp.proto``.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from google.protobuf.descriptor_pb2 import DescriptorProto, FileDescriptorProto

# The one file a writer schema may import (protobuf-java and Python's runtime both carry it).
TIMESTAMP_FILE = "google/protobuf/timestamp.proto"
TIMESTAMP_TYPE = ".google.protobuf.Timestamp"
# (full name, index path, message): the path as Confluent's wire format writes it.
Message = tuple[str, tuple[int, ...], "DescriptorProto"]


def descriptor(text: str) -> FileDescriptorProto | None:
    """The file of a registry answer (base64 descriptor or ``.proto`` text), or None if it is
    neither."""
    from google.protobuf.descriptor_pb2 import FileDescriptorProto
    from google.protobuf.message import DecodeError

    try:
        return FileDescriptorProto.FromString(base64.b64decode(text, validate=True))
    except (DecodeError, ValueError):
        return compile_proto(text)


def compile_proto(text: str) -> FileDescriptorProto | None:
    """``.proto`` text compiled to its ``FileDescriptorProto`` by protoc (grpcio-tools' wheel, in
    this process; the well-known types on its include path), or None if protoc refuses it."""
    import tempfile
    from pathlib import Path

    import grpc_tools
    from google.protobuf.descriptor_pb2 import FileDescriptorSet
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "writer.proto", Path(tmp) / "writer.desc"
        source.write_text(text)
        args = [f"-I{tmp}", f"-I{well_known}", f"--descriptor_set_out={out}", str(source)]
        code = protoc.main(["protoc", *args])
        if code != 0 or not out.is_file():
            return None
        files = FileDescriptorSet.FromString(out.read_bytes()).file
    return files[0] if len(files) == 1 else None


def messages(
    level: Iterable[DescriptorProto], prefix: str, path: tuple[int, ...] = ()
) -> list[Message]:
    """Every message of a file or message, nested ones too, in order."""
    found: list[Message] = []
    for i, msg in enumerate(level):
        name = f"{prefix}.{msg.name}" if prefix else msg.name
        found += [(name, (*path, i), msg), *messages(msg.nested_type, name, (*path, i))]
    return found


def chosen(file: FileDescriptorProto, message: str | None) -> Message | None:
    """The message a spec reads in ``file``: ``message`` (full name), else the file's first."""
    every = messages(file.message_type, file.package)
    if message is None:
        return every[0] if every else None
    return next((m for m in every if m[0] == message), None)
