"""A dependency-free writer of TensorBoard scalar summaries (TFRecord files of Event protos)."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

_CRC_TABLE: list[int] = []


def _crc32c(data: bytes) -> int:
    if not _CRC_TABLE:
        for n in range(256):
            c = n
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC_TABLE.append(c)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2, _varint(len(payload)) + payload)


def _event(step: int, *, summary: bytes = b"", file_version: str = "") -> bytes:
    event = _field(1, 1, struct.pack("<d", time.time())) + _field(2, 0, _varint(step))
    if file_version:
        event += _length_delimited(3, file_version.encode())
    if summary:
        event += _length_delimited(5, summary)
    return event


def scalar_summary(tag: str, value: float) -> bytes:
    """A Summary proto holding one scalar."""
    value_proto = _length_delimited(1, tag.encode()) + _field(2, 5, struct.pack("<f", value))
    return _length_delimited(1, value_proto)


class EventWriter:
    """Appends scalar events to one `events.out.tfevents.*` file in `log_dir`."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        os.makedirs(log_dir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(os.fspath(log_dir), name)
        self._file = open(self.path, "ab")  # noqa: SIM115 - kept open across epochs
        self._write(_event(0, file_version="brain.Event:2"))

    def _write(self, record: bytes) -> None:
        header = struct.pack("<Q", len(record))
        self._file.write(header + struct.pack("<I", _masked_crc(header)))
        self._file.write(record + struct.pack("<I", _masked_crc(record)))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._write(_event(step, summary=scalar_summary(tag, value)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_scalars(path: str | os.PathLike[str]) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in an event file; checks every CRC."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[pos + 8 : pos + 12])[0] != _masked_crc(header):
            raise ValueError(f"Corrupt record header at byte {pos} of {path}.")
        record = data[pos + 12 : pos + 12 + length]
        if struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] != _masked_crc(
            record
        ):
            raise ValueError(f"Corrupt record at byte {pos} of {path}.")
        pos += 16 + length
        out.extend(_scalars_of_event(record))
    return out


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes) -> list[tuple[int, Any]]:
    pos, out = 0, []
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, pos = _read_varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            length, pos = _read_varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        out.append((number, value))
    return out


def _scalars_of_event(record: bytes) -> list[tuple[int, str, float]]:
    fields = _fields(record)
    step = next((v for n, v in fields if n == 2), 0)
    out = []
    for number, summary in fields:
        if number != 5:
            continue
        for _, value_proto in _fields(summary):
            parts = dict(_fields(value_proto))
            out.append((step, parts[1].decode(), struct.unpack("<f", parts[2])[0]))
    return out
