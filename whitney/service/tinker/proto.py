"""Tinker's protobuf messages (tinker/proto/tinker_public.proto), read and written by hand.

Only the messages the SDK sends or expects as protobuf: ForwardBackwardRequest in, and
ForwardBackwardOutput and SampleResponse out. A small codec rather than generated code, so the
service needs neither the tinker package nor a protobuf runtime of a matching version.

Field numbers (from the SDK's descriptor):
  ForwardBackwardRequest: model_id 1, seq_id 2 (int32), data 3 (Datum), loss_fn 4,
      loss_fn_config 5 (map<string, double>), forward_only 6, loss_fn_config_v2 7 (map<string, {number 1, text 2}>)
  Datum: model_input 1 (Chunk), loss_fn_inputs 2 (map<string, Tensor>), spans 3, 4 (ignored: provenance only)
  Chunk: encoded_text 1 ({tokens 1: int32 bytes}), image 2, dmel 3
  Tensor: dense 1, sparse_csr 2 ({values 1, crow_indices 2, col_indices 3}), dtype 3, shape 4 (int64)
  ForwardBackwardOutput: loss_fn_output_type 1, loss_fn_outputs 2 (ArrayRecord), metrics 3 (map<string, double>)
  ArrayRecord: type_tag 1, fields 2 (map<string, BatchedTensor>), num_datums 3
  BatchedTensor: data 1, offsets 2 (int64 byte offsets), dtype 3, trailing_shape 4
  SampleResponse: sequences 1, prompt_logprobs 2 (float32 bytes), topk_prompt_logprobs 3, prompt_cache_hit_tokens 4
  SampledSequence: stop_reason 1 (0 stop, 1 length), tokens 2 (int32 bytes), logprobs 3 (float32 bytes), topk 4
  TopkLogprobs: token_ids 1 (int32 bytes), logprobs 2 (float32 bytes), k 3, length 4
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from whitney.errors import InvalidInput

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
_DTYPE_NAMES = {DTYPE_FLOAT32: "float32", DTYPE_INT64: "int64", DTYPE_INT32: "int32"}
TOPK_MASK = -99999.0
_STRUCT = {DTYPE_FLOAT32: "f", DTYPE_INT64: "q", DTYPE_INT32: "i"}


# ---- wire format ---------------------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise InvalidInput("truncated protobuf body", field="body")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidInput("malformed protobuf varint", field="body")


def fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """A message's (field number, value) pairs in order: ints for varints and fixed, bytes for the rest."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        else:
            raise InvalidInput(f"unsupported protobuf wire type {wire}", field="body")
        if pos > len(buf):
            raise InvalidInput("truncated protobuf body", field="body")
        out.append((number, value))
    return out


def _double(bits: int) -> float:
    return struct.unpack("<d", bits.to_bytes(8, "little"))[0]


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _repeated_int64(values: list[int | bytes]) -> list[int]:
    """Packed (bytes) or unpacked (ints) repeated int64."""
    out = []
    for v in values:
        if isinstance(v, bytes):
            pos = 0
            while pos < len(v):
                x, pos = _varint(v, pos)
                out.append(_signed64(x))
        else:
            out.append(_signed64(v))
    return out


def _map_entry(buf: bytes) -> tuple[str, int | bytes | None]:
    key, value = "", None
    for number, v in fields(buf):
        if number == 1:
            key = v.decode()
        elif number == 2:
            value = v
    return key, value


# ---- ForwardBackwardRequest in -------------------------------------------------------------

@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    forward_only: bool = False
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    data: list[dict] = field(default_factory=list)  # native wire datums: {input: {token_ids}, loss_inputs}


def _array(raw: bytes, dtype: int, what: str) -> list:
    code = _STRUCT.get(dtype)
    if code is None:
        raise InvalidInput(f"{what}: unsupported tensor dtype {dtype}", field=what)
    size = struct.calcsize(code)
    if len(raw) % size:
        raise InvalidInput(f"{what}: {len(raw)} bytes is not a whole number of {_DTYPE_NAMES[dtype]}", field=what)
    return list(struct.unpack(f"<{len(raw) // size}{code}", raw))


def _tensor(buf: bytes, what: str) -> dict:
    """A Tensor as the native wire tensor {dtype, shape, values}; sparse CSR made dense (absent cells 0)."""
    dense, csr, dtype, shape = b"", None, 0, []
    for number, v in fields(buf):
        if number == 1:
            dense = v
        elif number == 2:
            csr = {n: b for n, b in fields(v)}
        elif number == 3:
            dtype = v
        elif number == 4:
            shape.append(v)
    shape = _repeated_int64(shape)
    if csr is None:
        values = _array(dense, dtype, what)
        return {"dtype": _DTYPE_NAMES[dtype], "shape": shape or [len(values)], "values": values}
    values = _array(csr.get(1, b""), dtype, what)
    crow = _array(csr.get(2, b""), DTYPE_INT64, what)
    col = _array(csr.get(3, b""), DTYPE_INT64, what)
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or (crow and crow[-1] != len(values)):
        raise InvalidInput(f"{what}: sparse CSR tensor does not match its shape {shape}", field=what)
    rows, cols = shape
    out = [0] * (rows * cols)
    for r in range(rows):
        for i in range(crow[r], crow[r + 1]):
            if not 0 <= col[i] < cols:
                raise InvalidInput(f"{what}: sparse column index {col[i]} outside [0, {cols})", field=what)
            out[r * cols + col[i]] = values[i]
    return {"dtype": _DTYPE_NAMES[dtype], "shape": shape, "values": out}


def _datum(buf: bytes, index: int) -> dict:
    tokens: list[int] = []
    inputs: dict[str, dict] = {}
    for number, v in fields(buf):
        if number == 1:
            for kind, chunk in fields(v):
                if kind != 1:
                    raise InvalidInput(f"datum {index}: only token chunks are supported (no image or audio)",
                                       field="model_input", datum_index=index)
                for n, raw in fields(chunk):
                    if n == 1:
                        tokens.extend(_array(raw, DTYPE_INT32, "model_input"))
        elif number == 2:
            name, tensor = _map_entry(v)
            inputs[name] = _tensor(tensor or b"", name)
    return {"input": {"token_ids": tokens}, "loss_inputs": inputs}


def decode_forward_backward(body: bytes) -> ForwardBackwardRequest:
    req = ForwardBackwardRequest()
    v1: dict[str, float] = {}
    for number, v in fields(body):
        if number == 1:
            req.model_id = v.decode()
        elif number == 2:
            req.seq_id = v - (1 << 64) if v >= 1 << 63 else v
        elif number == 3:
            req.data.append(_datum(v, len(req.data)))
        elif number == 4:
            req.loss_fn = v.decode()
        elif number == 5:
            key, value = _map_entry(v)
            v1[key] = _double(value or 0)
        elif number == 6:
            req.forward_only = bool(v)
        elif number == 7:
            key, value = _map_entry(v)
            parts = dict(fields(value or b""))
            req.loss_fn_config[key] = parts[2].decode() if 2 in parts else _double(parts.get(1, 0))
    # v2 wins where both are given (the SDK writes both for numbers).
    req.loss_fn_config = {**v1, **req.loss_fn_config}
    return req


# ---- responses out -------------------------------------------------------------------------

def _key(number: int, wire: int) -> bytes:
    return _enc_varint(number << 3 | wire)


def _enc_varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _enc_varint(len(payload)) + payload


def _int(number: int, v: int) -> bytes:
    return _key(number, 0) + _enc_varint(v) if v else b""


def _f32(values: list[float | None]) -> bytes:
    return struct.pack(f"<{len(values)}f", *[math.nan if v is None else v for v in values])


def _i32(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _batched(per_datum: list[list[float]]) -> bytes:
    """A float32 BatchedTensor: all datums' values end to end, with byte offsets per datum."""
    offsets, total = [0], 0
    for values in per_datum:
        total += 4 * len(values)
        offsets.append(total)
    data = b"".join(_f32(v) for v in per_datum)
    return (_len(1, data) + _len(2, struct.pack(f"<{len(offsets)}q", *offsets)) + _int(3, DTYPE_FLOAT32))


def encode_forward_backward_output(result: dict) -> bytes:
    """The native forward result ({loss, metrics, outputs: [{logprobs, elementwise_loss}]}) as Tinker's proto."""
    outputs = result["outputs"]
    record = _len(1, b"ArrayRecord")
    for name, key in (("logprobs", "logprobs"), ("elementwise_loss", "elementwise_loss")):
        entry = _len(1, name.encode()) + _len(2, _batched([o[key] for o in outputs]))
        record += _len(2, entry)
    record += _int(3, len(outputs))
    msg = _len(1, b"ArrayRecord") + _len(2, record)
    for name, value in result["metrics"].items():
        entry = _len(1, name.encode()) + _key(2, 1) + struct.pack("<d", float(value))
        msg += _len(3, entry)
    return msg


def _topk(rows: list[list[tuple[int, float]] | None]) -> bytes:
    """TopkLogprobs [length, k], row-major; missing entries (the first prompt position) are the SDK's
    sentinel, token 0 with log-prob -99999."""
    k = max((len(r) for r in rows if r), default=0)
    ids, lps = [], []
    for r in rows:
        r = list(r or [])
        ids.extend([t for t, _ in r] + [0] * (k - len(r)))
        lps.extend([lp for _, lp in r] + [TOPK_MASK] * (k - len(r)))
    return _len(1, _i32(ids)) + _len(2, _f32(lps)) + _int(3, k) + _int(4, len(rows))


def encode_sample_response(result: dict, last_n: int | None = None) -> bytes:
    """The native sample result as Tinker's SampleResponse. `last_n`: only the last n prompt log-probs."""
    msg = b""
    for seq in result["sequences"]:
        body = _int(1, 0 if seq["stop_reason"] == "stop" else 1)
        body += _len(2, _i32(seq["tokens"])) + _len(3, _f32(seq["logprobs"]))
        msg += _len(1, body)
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        if last_n is not None:
            prompt = [None] * (len(prompt) - last_n) + prompt[len(prompt) - last_n:]
        msg += _len(2, _f32(prompt))
    topk = result.get("topk_prompt_logprobs")
    if topk is not None:
        if last_n is not None:
            topk = [None] * (len(topk) - last_n) + topk[len(topk) - last_n:]
        msg += _len(3, _topk([[tuple(x) for x in r] if r else None for r in topk]))
    return msg
