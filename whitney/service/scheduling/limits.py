"""What one request may ask for, and how the worker shares itself between runs.

Every bound is the operator's (`whitney serve --max-...`, `ServiceConfig.limits`) and is shown in
`/v1/training/capabilities`. A request beyond one is refused before anything is queued or stored,
with a 413 whose message states the limit and what was asked (`TooLarge`).

Fairness: the worker never runs more than `max_batch_tokens` tokens of training in one engine call.
`plan_micro_batches` shares that budget between the runs that have a forward or forward_backward
ready, max-min fair (water-filling): small operations run whole, and what is left goes to the large
ones, which run a prefix of their datums (a micro-batch) per call, their gradients staged until the
last one. Between two engine calls the worker runs other runs' steps and a decode step of sampling,
so a large operation slows the others by a bounded factor, not by its whole length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from whitney.errors import TooLarge
from whitney.service.flags import flag
from whitney.service.store.json_values import check_json


@dataclass(frozen=True)
class Limits:
    """Each field is a `whitney serve --max-...` flag (its help is the metadata below)."""

    max_request_bytes: int = flag(32 * 2**20, "bytes of a request body")
    max_operation_tokens: int = flag(131_072, "tokens of one forward, forward_backward or compute_logprobs request")
    max_operation_datums: int = flag(4096, "datums (or scored sequences) of one request")
    max_metadata_bytes: int = flag(16_384, "user_metadata of a session or run, as compact UTF-8 JSON")
    max_stop_sequences: int = flag(32, "stop strings or token sequences of one sample request")
    max_stop_length: int = flag(256, "characters of a stop string, tokens of a stop sequence")
    # It bounds how long one engine call, and so any wait behind it, lasts. On a CPU the time of a call grows
    # with its tokens (no larger batch is more efficient), so a small budget costs no throughput there.
    max_batch_tokens: int = flag(8192, "training tokens per engine call: larger operations run as "
                                         "micro-batches, other runs' work in between")
    # Image chunks (service/images.py): checked on the encoded bytes and the header, before any decoding.
    max_image_bytes: int = flag(10 * 2**20, "encoded bytes of one image chunk")
    max_image_pixels: int = flag(1 << 23, "pixels (width x height) of one image, read from its header; decoding "
                                 "takes up to about 10 bytes a pixel")
    max_request_images: int = flag(64, "image chunks of one request")
    max_request_image_bytes: int = flag(32 * 2**20, "encoded image bytes of one request")
    # Directories whose files image_asset_pointer chunks may name (`whitney serve --image-dir DIR`, repeatable);
    # none: every pointer is refused. Not a number, so not shown in capabilities.
    image_dirs: tuple[str, ...] = field(default=(), metadata={"help": "directory of images that asset pointers "
                                                                      "may name"})

    def as_dict(self) -> dict[str, int]:
        """The numeric limits (what capabilities show)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), int)}


def check_operation(limits: Limits, lengths: list[int], field: str = "data") -> int:
    """Refuse a request of too many datums or tokens (`lengths`: tokens of each datum); return its tokens."""
    if len(lengths) > limits.max_operation_datums:
        raise TooLarge(f"{field} holds {len(lengths)} items; the limit is {limits.max_operation_datums} per request",
                       field=field)
    tokens = sum(lengths)
    if tokens > limits.max_operation_tokens:
        raise TooLarge(f"{field} holds {tokens} tokens; the limit is {limits.max_operation_tokens} per request "
                       "(split it into several requests)", field=field)
    return tokens


def check_metadata(limits: Limits, metadata: dict | None, field: str = "user_metadata") -> None:
    """A 400 for metadata nested too deep (json_values.MAX_DEPTH), a 413 for one too large, before it is stored."""
    check_json(metadata, field)  # first: serialising a deep value would recurse
    size = len(json.dumps(metadata or {}, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace"))
    if size > limits.max_metadata_bytes:
        raise TooLarge(f"{field} is {size} bytes as JSON; the limit is {limits.max_metadata_bytes}", field=field)


def check_stops(limits: Limits, stop) -> None:
    """Stop strings are matched after every sampled token: their number and length are bounded."""
    if stop is None or isinstance(stop, (str, int)):
        stop = () if stop is None else (stop,)
    if len(stop) > limits.max_stop_sequences:
        raise TooLarge(f"stop holds {len(stop)} entries; the limit is {limits.max_stop_sequences}", field="stop")
    for s in stop:
        if isinstance(s, (str, list, tuple)) and len(s) > limits.max_stop_length:
            raise TooLarge(f"a stop entry of length {len(s)} exceeds the limit of {limits.max_stop_length}",
                           field="stop")


def plan_micro_batches(remaining: list[list[int]], budget: int, credit: list[int] | None = None,
                       reserved: list[int] = ()) -> tuple[list[int], list[int]]:
    """How many leading datums of each operation run in the next engine call, and each operation's credit
    after it: deficit round robin (Shreedhar and Varghese), in tokens' worth of engine work.

    remaining[i]: the costs of operation i's datums not yet run (tokens, and a custom loss's graph work as
    positions' worth: `ForwardJob.shares`). credit[i]: what operation i earned in the calls it waited through
    and has not spent (0 for a new one). reserved: the usual demand (in tokens) of each run that trained a
    moment ago and will be back with its next operation shortly (it is waiting on its client, or on its
    optim_step): its share is set aside, so a large operation that finds the worker free for an instant does
    not fill the whole call and hold that run up.
    Operations and reservations are visited from the smallest to the largest; each may use an equal share
    of what is left of `budget`, topped up by its credit as far as the budget goes. An operation that fits
    runs whole; a larger one runs the longest prefix of datums that fits. One whose next datum costs more
    than it may use waits, and earns an equal share of the budget (budget / (operations + reservations)) per
    call it waits, until its credit alone pays for that datum: then it runs, the call exceeding the budget by
    that datum if need be. So a datum that costs k shares runs once in about k calls: a run's share of the
    engine is its share of the work, however large its datums. Nothing waits forever, and the engine never
    idles while work is ready: a call that would run nothing runs one datum of the operation nearest to
    affording it. An operation's credit after a call is what it may use and did not, 0 once it ran whole.
    """
    credit = list(credit) if credit is not None else [0] * len(remaining)
    demands = [(sum(r), i) for i, r in enumerate(remaining)] + [(d, -1) for d in reserved]
    quantum = budget // max(len(demands), 1)  # an equal share: what a waiting operation earns per call
    counts = [0] * len(remaining)
    left, budget_left = len(demands), budget
    for demand, i in sorted(demands):
        share = budget_left // left if budget_left > 0 else 0
        left -= 1
        if i < 0:  # a reservation: its share stays unused in this call
            budget_left -= min(demand, share)
            continue
        # Owed (its credit pays for its next datum): it runs, the call exceeding the budget by that datum if need
        # be. Else its credit may make up a share the budget left short, never grow the call past the budget.
        owed = remaining[i] and credit[i] >= remaining[i][0]
        allowed, used = share + credit[i] if owed else min(share + credit[i], max(budget_left, 0)), 0
        for length in remaining[i]:
            if used + length > allowed:
                break
            counts[i] += 1
            used += length
        credit[i] = 0 if counts[i] == len(remaining[i]) else (allowed - used if counts[i] else credit[i] + quantum)
        budget_left -= used
    if not any(counts) and any(remaining):  # nothing affordable: the nearest runs one datum
        i = max((i for i, r in enumerate(remaining) if r), key=lambda i: credit[i] - remaining[i][0])
        counts[i], credit[i] = 1, 0 if len(remaining[i]) == 1 else max(credit[i] - remaining[i][0], 0)
    return counts, credit
