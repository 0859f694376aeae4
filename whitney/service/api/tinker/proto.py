"""Tinker's protobuf messages (tinker/proto/tinker_public.proto), read and written by hand.

Only the messages the SDK sends or expects as protobuf: ForwardBackwardRequest in, and
ForwardBackwardOutput and SampleResponse out. A small codec rather than generated code, so the
service needs neither the tinker package nor a protobuf runtime of a matching version.

Field numbers (from the SDK's descriptor):
  ForwardBackwardRequest: model_id 1, seq_id 2 (int32), data 3 (Datum), loss_fn 4,
      loss_fn_config 5 (map<string, double>), forward_only 6, loss_fn_config_v2 7 (map<string, {number 1, text 2}>)
  Datum: model_input 1 (Chunk), loss_fn_inputs 2 (map<string, Tensor>), spans 3, 4 (ignored: provenance only)
  Chunk: encoded_text 1 ({tokens 1: int32 bytes}), image 2, dmel 3 (refused: audio)
  ImageChunk: data 1 (bytes), format 2 ("png" | "jpeg"), expected_tokens 3 (int32, optional),
      override_dimensions 4 (refused)
  Tensor: dense 1, sparse_csr 2 ({values 1, crow_indices 2, col_indices 3}), dtype 3, shape 4 (int64)
  ForwardBackwardOutput: loss_fn_output_type 1, loss_fn_outputs 2 (ArrayRecord), metrics 3 (map<string, double>)
  ArrayRecord: type_tag 1, fields 2 (map<string, BatchedTensor>), num_datums 3
  BatchedTensor: data 1, offsets 2 (int64 byte offsets), dtype 3, trailing_shape 4
  SampleResponse: sequences 1, prompt_logprobs 2 (float32 bytes), topk_prompt_logprobs 3, prompt_cache_hit_tokens 4,
      target_prompt_logprobs 5 (Tensor)
  SampledSequence: stop_reason 1 (0 stop, 1 length), tokens 2 (int32 bytes), logprobs 3 (float32 bytes),
      topk_sampled_logprobs 4
  TopkLogprobs: token_ids 1 (int32 bytes), logprobs 2 (float32 bytes), k 3, length 4
"""

from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass, field

from whitney.errors import InvalidInput, TooLarge
from whitney.protocol.training import MAX_DIMS, MAX_K
from whitney.service.scheduling.limits import Limits
from whitney.service.scheduling.results import StopReason

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
_DTYPE_NAMES = {DTYPE_FLOAT32: "float32", DTYPE_INT64: "int64", DTYPE_INT32: "int32"}
TOPK_MASK = -99999.0
log = logging.getLogger("whitney.tinker")
_STRUCT = {DTYPE_FLOAT32: "f", DTYPE_INT64: "q", DTYPE_INT32: "i"}


# ---- wire format ---------------------------------------------------------------------------
# Every read names the field it reads (`where`, e.g. "data[3].loss_fn_inputs.weights"): a truncated
# message, a wrong wire type, invalid UTF-8 or a tensor that does not fit its datum is an InvalidInput
# for that field, never an exception of the codec.

WIRE_NAMES = {0: "varint", 1: "fixed64", 2: "length-delimited", 5: "fixed32"}


@dataclass(frozen=True)
class Field:
    number: int
    wire: int
    value: int | bytes  # int for varint and fixed, bytes for length-delimited


def _bad(where: str, what: str) -> InvalidInput:
    return InvalidInput(f"{where}: {what}", field=where)


def _varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise _bad(where, "truncated protobuf varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _bad(where, "protobuf varint longer than 10 bytes")


def fields(buf: bytes, where: str = "body") -> list[Field]:
    """A message's fields in order. `where` names the message in errors (truncation, unknown wire type)."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos, where)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _bad(where, "protobuf field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos, where)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(buf):
                raise _bad(where, f"truncated {WIRE_NAMES[wire]} field {number}")
            value, pos = int.from_bytes(buf[pos:pos + size], "little"), pos + size
        elif wire == 2:
            n, pos = _varint(buf, pos, where)
            if pos + n > len(buf):
                raise _bad(where, f"field {number} declares {n} bytes; {len(buf) - pos} remain")
            value, pos = buf[pos:pos + n], pos + n
        else:
            raise _bad(where, f"unsupported protobuf wire type {wire} (field {number})")
        out.append(Field(number, wire, value))
    return out


def _expect(f: Field, wire: int, where: str) -> int | bytes:
    if f.wire != wire:
        raise _bad(where, f"expected a {WIRE_NAMES[wire]} field (wire type {wire}), got wire type {f.wire}")
    return f.value


def _uint(f: Field, where: str) -> int:
    return _expect(f, 0, where)


def _int64(f: Field, where: str) -> int:
    v = _uint(f, where)
    return v - (1 << 64) if v >= 1 << 63 else v


def _double(f: Field, where: str) -> float:
    return struct.unpack("<d", _expect(f, 1, where).to_bytes(8, "little"))[0]


def _bytes(f: Field, where: str) -> bytes:
    return _expect(f, 2, where)


def _text(f: Field, where: str) -> str:
    raw = _bytes(f, where)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(where, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def _message(f: Field, where: str) -> list[Field]:
    return fields(_bytes(f, where), where)


def _int64s(fs: list[Field], where: str) -> list[int]:
    """A repeated int64, packed (one length-delimited field) or not (one varint each)."""
    out = []
    for f in fs:
        if f.wire == 2:
            raw, pos = f.value, 0
            while pos < len(raw):
                x, pos = _varint(raw, pos, where)
                out.append(x - (1 << 64) if x >= 1 << 63 else x)
        else:
            out.append(_int64(f, where))
    return out


def _map_entry(f: Field, where: str) -> tuple[str, Field | None]:
    """A map<string, V> entry: its key and its value field (None when absent)."""
    key, value = "", None
    for g in _message(f, where):
        if g.number == 1:
            key = _text(g, f"{where} key")
        elif g.number == 2:
            value = g
    return key, value


# ---- ForwardBackwardRequest in -------------------------------------------------------------

@dataclass
class Bounds:
    """What a body's declared numbers may still reach, counted as it is read, so that nothing is made from a
    declared number before it is checked: datums and positions (max_operation_datums, max_operation_tokens; an
    image counts its expected_tokens), and the values sparse tensors expand to (`sparse_values`: what a dense
    body of max_request_bytes could hold, 4 bytes a value, so a sparse tensor never costs more than its dense
    form could). Beyond one: a 413, before the next datum or tensor is read."""

    limits: Limits
    datums: int = 0
    tokens: int = 0
    values: int = 0

    @property
    def sparse_values(self) -> int:
        return self.limits.max_request_bytes // 4

    def add_datum(self, positions: int, where: str) -> None:
        self.datums += 1
        self.tokens += positions
        if self.datums > self.limits.max_operation_datums:
            raise TooLarge(f"data holds more than {self.limits.max_operation_datums} datums; the limit is "
                           f"{self.limits.max_operation_datums} per request", field="data")
        if self.tokens > self.limits.max_operation_tokens:
            raise TooLarge(f"data holds at least {self.tokens} tokens (through {where}; an image counts its "
                           f"expected_tokens); the limit is {self.limits.max_operation_tokens} per request (split "
                           "it into several requests)", field="data")

    def add_sparse(self, shape: list[int], where: str) -> None:
        rows, cols = shape
        if rows > self.limits.max_operation_tokens:
            raise TooLarge(f"{where}: a sparse tensor of {rows} rows; no request holds more than "
                           f"{self.limits.max_operation_tokens} positions (max_operation_tokens)", field=where)
        self.values += rows * cols
        if self.values > self.sparse_values:
            raise TooLarge(f"{where}: the request's sparse tensors expand to {self.values} values or more; the "
                           f"limit is {self.sparse_values} (what a dense body of max_request_bytes holds)", field=where)


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    forward_only: bool = False
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    data: list[dict] = field(default_factory=list)  # native wire datums: {input: {token_ids}, loss_inputs}


def _array(raw: bytes, dtype: int, where: str) -> list:
    code = _STRUCT.get(dtype)
    if code is None:
        raise _bad(where, f"unsupported tensor dtype {dtype}; expected float32 (1), int64 (2) or int32 (3)")
    size = struct.calcsize(code)
    if len(raw) % size:
        raise _bad(where, f"{len(raw)} bytes is not a whole number of {_DTYPE_NAMES[dtype]}")
    return list(struct.unpack(f"<{len(raw) // size}{code}", raw))


def _tensor(f: Field | None, where: str, n: int | None, bounds: Bounds) -> dict:
    """A Tensor as the native wire tensor {dtype, shape, values}, checked before anything is allocated:
    at most MAX_DIMS dimensions, none negative; dense values fill the shape exactly; a sparse CSR tensor is
    [n, K] (n the datum's tokens, 1 <= K <= MAX_K) within `bounds`, with consistent indices, and only then made
    dense. Dense values cost no more than the body's bytes; their rows are the engine's to check (an opsd
    teacher field has M rows, not n)."""
    dense, csr, dtype, dims = b"", None, 0, []
    for g in _message(f, where) if f is not None else []:
        if g.number == 1:
            dense = _bytes(g, f"{where}.dense")
        elif g.number == 2:
            csr = {h.number: _bytes(h, f"{where}.sparse_csr") for h in _message(g, f"{where}.sparse_csr")
                   if h.number in (1, 2, 3)}
        elif g.number == 3:
            dtype = _uint(g, f"{where}.dtype")
        elif g.number == 4:
            dims.append(g)
    shape = _int64s(dims, f"{where}.shape")
    if len(shape) > MAX_DIMS or any(s < 0 for s in shape):
        raise _bad(where, f"shape {shape} must have at most {MAX_DIMS} non-negative dimensions")
    if csr is None:
        values = _array(dense, dtype, where)
        if shape and math.prod(shape) != len(values):
            raise _bad(where, f"{len(values)} values do not fill shape {shape}")
        return {"dtype": _DTYPE_NAMES[dtype], "shape": shape or [len(values)], "values": values}
    if len(shape) != 2 or (n is not None and shape[0] != n) or not 1 <= shape[1] <= MAX_K:
        rows = "N" if n is None else n  # None: an image's positions are counted by the engine
        raise _bad(where, f"a sparse tensor must have shape [{rows}, K] (the datum's {rows} positions, 1 <= K <= "
                          f"{MAX_K}), got {shape}")
    bounds.add_sparse(shape, where)  # before its indices are read or anything is made of its shape
    values = _array(csr.get(1, b""), dtype, f"{where}.sparse_csr.values")
    crow = _array(csr.get(2, b""), DTYPE_INT64, f"{where}.sparse_csr.crow_indices")
    col = _array(csr.get(3, b""), DTYPE_INT64, f"{where}.sparse_csr.col_indices")
    rows, cols = shape
    if (len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(values) or len(col) != len(values)
            or any(a > b for a, b in zip(crow, crow[1:]))):
        raise _bad(where, f"sparse CSR indices do not match shape {shape} and {len(values)} values: crow_indices "
                          f"must be {rows + 1} non-decreasing offsets from 0 to {len(values)}, one column each")
    bad = next((c for c in col if not 0 <= c < cols), None)
    if bad is not None:
        raise _bad(where, f"sparse column index {bad} outside [0, {cols})")
    out = [0.0 if dtype == DTYPE_FLOAT32 else 0] * (rows * cols)
    for r in range(rows):
        for i in range(crow[r], crow[r + 1]):
            out[r * cols + col[i]] = values[i]
    return {"dtype": _DTYPE_NAMES[dtype], "shape": shape, "values": out}


def _chunk(f: Field, where: str, j: int) -> dict:
    """One Chunk of model_input as a native chunk dict: encoded text (int32 token ids) or an image (its bytes,
    format and expected_tokens, checked by service/images.py). Audio (dmel) and image dimension overrides are
    refused. `where` names the datum's model_input, `j` the chunk's index in it."""
    chunk: dict | None = None
    for kind in _message(f, where):
        if kind.number == 1:
            tokens = [t for g in _message(kind, f"{where}.encoded_text") if g.number == 1
                      for t in _array(_bytes(g, f"{where}.encoded_text.tokens"), DTYPE_INT32,
                                      f"{where}.encoded_text.tokens")]
            chunk = {"type": "encoded_text", "tokens": tokens}
        elif kind.number == 2:
            chunk = {"type": "image", "data": b"", "format": "", "expected_tokens": None}
            for g in _message(kind, f"{where}.image"):
                if g.number == 1:
                    chunk["data"] = _bytes(g, f"{where}.image.data")
                elif g.number == 2:
                    chunk["format"] = _text(g, f"{where}.image.format")
                elif g.number == 3:
                    chunk["expected_tokens"] = _int64(g, f"{where}.image.expected_tokens")
                    if chunk["expected_tokens"] < 1:  # it counts toward the datum's positions just below
                        raise _bad(f"{where}.image.expected_tokens", f"chunk {j}: expected_tokens must be a "
                                   f"positive integer, got {chunk['expected_tokens']}")
                elif g.number == 4:
                    raise _bad(f"{where}.image.override_dimensions", f"chunk {j}: override_dimensions is not "
                               "supported by this server (the image is processed at its encoded size)")
        elif kind.number == 3:
            raise _bad(where, f"chunk {j} has type 'dmel' (audio), which is not supported; a chunk is "
                              "encoded_text or image")
        else:
            raise _bad(where, f"chunk {j} has an unknown type (field {kind.number}); a chunk is encoded_text or image")
    if chunk is None:
        raise _bad(where, f"chunk {j} is empty")
    if chunk["type"] == "image" and not (chunk["data"] and chunk["format"]):  # malformed, whatever the model takes
        raise _bad(where, f"chunk {j}: an image chunk needs its data and format")
    return chunk


def _datum(f: Field, index: int, bounds: Bounds) -> dict:
    """One Datum. model_input is read first whatever the field order, since tensors are checked against it:
    token ids when it holds only text, else its chunks ({input: {chunks}}, images read by service/images.py).
    Its positions count against `bounds` before any tensor is read."""
    where = f"data[{index}]"
    try:
        parts = _message(f, where)
        chunks = [_chunk(g, f"{where}.model_input", j) for j, g in enumerate(g for g in parts if g.number == 1)]
        text = all(c["type"] == "encoded_text" for c in chunks)
        # An image's positions are known here only from its expected_tokens (the engine checks them).
        n = sum(len(c["tokens"]) if c["type"] == "encoded_text" else c["expected_tokens"] or 0 for c in chunks)
        bounds.add_datum(n, where)
        unsized = any(c["type"] == "image" and c["expected_tokens"] is None for c in chunks)
        inputs: dict[str, dict] = {}
        for g in parts:
            if g.number == 2:
                name, tensor = _map_entry(g, f"{where}.loss_fn_inputs")
                inputs[name] = _tensor(tensor, f"{where}.loss_fn_inputs.{name}", None if unsized else n, bounds)
    except (InvalidInput, TooLarge) as e:
        e.datum_index = index
        raise
    model_input = {"token_ids": [t for c in chunks for t in c["tokens"]]} if text else {"chunks": chunks}
    return {"input": model_input, "loss_inputs": inputs}


def _config_value(f: Field | None, where: str) -> float | str:
    """A LossConfigValue: number 1 (double) or text 2."""
    value: float | str = 0.0
    for g in _message(f, where) if f is not None else []:
        if g.number == 1:
            value = _double(g, where)
        elif g.number == 2:
            value = _text(g, where)
    return value


def decode_forward_backward(body: bytes, limits: Limits) -> ForwardBackwardRequest:
    """A ForwardBackwardRequest; any malformed part is an InvalidInput naming its field, any declared size
    beyond `limits` a TooLarge (`Bounds`), found before anything is made of it. Unknown fields are skipped
    (newer SDKs add some), as protobuf does. CPU work proportional to the body: call it off the event loop."""
    try:
        return _forward_backward(body, Bounds(limits))
    except (InvalidInput, TooLarge):
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error):
        # A safety net for a gap in the readers above (a bug, logged): the body is still the caller's.
        log.exception("protobuf decoder failed on a %d-byte body", len(body))
        raise InvalidInput("malformed ForwardBackwardRequest body", field="body") from None


def _forward_backward(body: bytes, bounds: Bounds) -> ForwardBackwardRequest:
    req = ForwardBackwardRequest()
    v1: dict[str, float] = {}
    v2: dict[str, float | str] = {}
    for f in fields(body):
        if f.number == 1:
            req.model_id = _text(f, "model_id")
        elif f.number == 2:
            req.seq_id = _int64(f, "seq_id")
        elif f.number == 3:
            req.data.append(_datum(f, len(req.data), bounds))
        elif f.number == 4:
            req.loss_fn = _text(f, "loss_fn")
        elif f.number == 5:
            key, value = _map_entry(f, "loss_fn_config")
            v1[key] = 0.0 if value is None else _double(value, f"loss_fn_config.{key}")
        elif f.number == 6:
            req.forward_only = bool(_uint(f, "forward_only"))
        elif f.number == 7:
            key, value = _map_entry(f, "loss_fn_config_v2")
            v2[key] = _config_value(value, f"loss_fn_config_v2.{key}")
    # v2 wins where both are given (the SDK writes both for numbers).
    req.loss_fn_config = {**v1, **v2}
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


def encode_sample_response(result: dict) -> bytes:
    """The native sample result as Tinker's SampleResponse (the engine already applied prompt_logprobs_last_n)."""
    msg = b""
    for seq in result["sequences"]:
        body = _int(1, 0 if seq["stop_reason"] == StopReason.STOP else 1)
        body += _len(2, _i32(seq["tokens"])) + _len(3, _f32(seq["logprobs"]))
        if seq.get("top_logprobs") is not None:  # topk_sample_logprobs: [len(tokens), k]
            body += _len(4, _topk([[tuple(x) for x in r] for r in seq["top_logprobs"]]))
        msg += _len(1, body)
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        msg += _len(2, _f32(prompt))
    topk = result.get("topk_prompt_logprobs")
    if topk is not None:
        msg += _len(3, _topk([[tuple(x) for x in r] if r else None for r in topk]))
    if result.get("target_prompt_logprobs") is not None:
        msg += _len(5, _target_tensor(result["target_prompt_logprobs"]))
    return msg


def _target_tensor(rows: list[list[float | None]]) -> bytes:
    """target_prompt_logprobs [P-1, K] as a float32 Tensor, 0.0 where nothing was asked (None). Sparse CSR
    with only the asked cells when that is smaller, by the SDK's own rule (TensorData.from_torch_sparse), so a
    sparse request gets a sparse answer; either way `to_torch()` gives the same dense tensor."""
    n, k = len(rows), len(rows[0])
    cells = [(r, c, v) for r, row in enumerate(rows) for c, v in enumerate(row) if v is not None]
    shape = _len(4, b"".join(_enc_varint(d) for d in (n, k))) + _int(3, DTYPE_FLOAT32)
    if (n + 1) + 2 * len(cells) >= n * k:
        return _len(1, _f32([0.0 if v is None else v for row in rows for v in row])) + shape
    crow = [0] * (n + 1)
    for r, _, _ in cells:
        crow[r + 1] += 1
    for r in range(n):
        crow[r + 1] += crow[r]
    csr = (_len(1, _f32([v for _, _, v in cells])) + _len(2, struct.pack(f"<{n + 1}q", *crow))
           + _len(3, struct.pack(f"<{len(cells)}q", *[c for _, c, _ in cells])))
    return _len(2, csr) + shape
