"""The Tinker wire format, with the SDK's own types: request bodies parsed by ``tinker.types`` (pydantic),
protobuf results written with ``tinker.proto.tinker_public_pb2`` (the SDK reads forward / forward_backward
and sample results only as protobuf), everything else JSON shaped as the SDK's response models.

  request = parse(types.CreateModelRequest, body_bytes)          # RequestError naming the field
  datums = datums_of(forward_backward_request_from_proto(body))   # -> list[engine.DatumIn]
  forward_backward_output(loss_kind, total, logprobs) -> bytes    # protobuf ForwardBackwardOutput
  sample_response(sequences, prompt_logprobs) -> bytes             # protobuf SampleResponse
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import pydantic
from rljob.trainer.tinker.engine import DatumIn, RequestError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

__all__ = [
    "PROTO_CONTENT_TYPE",
    "ForwardBackwardCall",
    "check_spans",
    "datums_of",
    "error_body",
    "forward_backward_output",
    "parse",
    "parse_forward_backward",
    "sample_response",
    "tokens_of",
]

PROTO_CONTENT_TYPE = "application/x-protobuf"
M = TypeVar("M", bound=pydantic.BaseModel)

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def parse[M: pydantic.BaseModel](model: type[M], body: bytes) -> M:
    """``body`` (JSON) as the SDK's request type; every validation problem in one RequestError line."""
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        problems = [f"{'.'.join(str(p) for p in err['loc']) or '(body)'}: {err['msg']}" for err in e.errors()]
        raise RequestError("; ".join(problems)) from None


def error_body(message: str, category: str = "user") -> dict[str, str]:
    """A failed future as the SDK reads it (``RequestFailedError`` with this message and category)."""
    return {"error": message, "category": category}


def tokens_of(model_input: types.ModelInput, where: str) -> np.ndarray:
    """The token ids of a ModelInput of text chunks (images and audio are not supported here)."""
    out: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise RequestError(
                f"{where}.chunks[{i}]: {type(chunk).__name__} is not supported (text tokens only)"
            )
        out.extend(chunk.tokens)
    return np.asarray(out, np.int64)


# ---------------------------------------------------------------------------------- forward_backward


class ForwardBackwardCall:
    """A decoded forward_backward request (protobuf ForwardBackwardRequest)."""

    def __init__(self, msg: Any) -> None:
        self.model_id: str = msg.model_id
        self.seq_id: int = int(msg.seq_id)
        self.loss_fn: str = msg.loss_fn
        self.forward_only: bool = bool(msg.forward_only)
        cfg: dict[str, float | str] = {}
        for k, v in msg.loss_fn_config_v2.items():
            cfg[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
        for k, num in msg.loss_fn_config.items():
            cfg.setdefault(k, float(num))
        self.loss_fn_config = cfg
        self.data = msg.data


def parse_forward_backward(body: bytes) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise RequestError(f"body: not a ForwardBackwardRequest protobuf ({e})") from None
    return ForwardBackwardCall(msg)


def _tensor(msg: Any, where: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise RequestError(f"{where}: unsupported dtype {msg.dtype}")
    if msg.HasField("sparse_csr"):
        shape = list(msg.shape)
        if len(shape) != 2:
            raise RequestError(f"{where}: a sparse tensor must be 2-D")
        raise RequestError(f"{where}: 2-D (sparse) loss inputs are not supported (one value per token)")
    arr = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape)
    if shape and int(np.prod(shape)) != arr.size:
        raise RequestError(f"{where}: shape {shape} does not hold {arr.size} values")
    if len(shape) > 1:
        raise RequestError(f"{where}: shape {shape}; this server takes one value per token ([N])")
    return arr


def datums_of(call: ForwardBackwardCall, allowed: frozenset[str], required: frozenset[str]) -> list[DatumIn]:
    """The request's datums as engine inputs; unknown or missing loss inputs are refused by name."""
    out = []
    for i, d in enumerate(call.data):
        tokens: list[int] = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise RequestError(
                    f"data[{i}].model_input.chunks[{j}]: {kind} is not supported (text tokens only)"
                )
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        names = set(d.loss_fn_inputs.keys())
        extra, missing = sorted(names - allowed), sorted(required - names)
        if extra:
            raise RequestError(f"data[{i}].loss_fn_inputs: {extra} not read by loss {call.loss_fn}")
        if missing:
            raise RequestError(f"data[{i}].loss_fn_inputs: loss {call.loss_fn} needs {missing}")
        t = {k: _tensor(d.loss_fn_inputs[k], f"data[{i}].loss_fn_inputs.{k}") for k in names}
        check_spans(d, f"data[{i}]", len(tokens), int(t["target_tokens"].size))
        out.append(
            DatumIn(
                tokens=np.asarray(tokens, np.int64),
                targets=t["target_tokens"].astype(np.int64),
                weights=t.get("weights"),
                advantages=t.get("advantages"),
                logprobs=t.get("logprobs"),
            )
        )
    return out


def _span_problems(spans: Any, where: str, length: int) -> list[str]:
    problems, total = [], 0
    for j, span in enumerate(spans):
        arm = span.WhichOneof("span")
        if arm is None:
            problems.append(f"{where}[{j}]: neither prompt_tokens nor sampled_tokens")
            continue
        run = getattr(span, arm)
        if not run.sequence_id:
            problems.append(f"{where}[{j}].{arm}.sequence_id: empty")
        if run.offset < 0 or run.length < 0:
            problems.append(
                f"{where}[{j}].{arm}: offset {run.offset}, length {run.length}; both must be >= 0"
            )
        total += run.length
    if total != length:
        problems.append(f"{where}: the runs cover {total} positions, the field has {length}")
    return problems


def check_spans(d: Any, where: str, n_tokens: int, n_targets: int) -> None:
    """A datum's provenance spans (``Datum.with_provenance``), which no loss served here reads: accepted
    when they are as the SDK builds them, a pair of run lists tiling ``model_input`` and
    ``loss_fn_inputs["target_tokens"]`` exactly (lengths summing to each field's length)."""
    model_spans, target_spans = d.model_input_spans, d.loss_fn_input_spans
    if not len(model_spans) and not len(target_spans):
        return
    if not len(model_spans) or not len(target_spans):
        raise RequestError(
            f"{where}: provenance comes as a pair (model_input_spans and loss_fn_input_spans, "
            "Datum.with_provenance); got only one"
        )
    problems = _span_problems(model_spans, f"{where}.model_input_spans", n_tokens)
    problems += _span_problems(target_spans, f"{where}.loss_fn_input_spans", n_targets)
    if problems:
        raise RequestError("; ".join(problems))


def _batched(arrays: Sequence[np.ndarray], dtype: Any) -> Any:
    flat = [np.ascontiguousarray(a, dtype) for a in arrays]
    offsets = np.zeros(len(flat) + 1, np.int64)
    np.cumsum([a.nbytes for a in flat], out=offsets[1:])
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in flat),
        offsets=offsets.tobytes(),
        dtype=pb.DTYPE_FLOAT32,
        trailing_shape=[],
    )


def forward_backward_output(
    loss_kind: str, total: float, logprobs: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None = None
) -> bytes:
    """ForwardBackwardOutput: ``loss:sum`` and per datum its target ``logprobs`` (and, for cross_entropy,
    ``elementwise_loss`` = -weights * logprobs)."""
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    out.metrics["loss:sum"] = float(total)
    if logprobs:
        rec = out.loss_fn_outputs.add()
        rec.num_datums = len(logprobs)
        rec.fields["logprobs"].CopyFrom(_batched(logprobs, np.float32))
        if loss_kind == "cross_entropy" and weights is not None:
            losses = [-(w * lp) for w, lp in zip(weights, logprobs, strict=True)]
            rec.fields["elementwise_loss"].CopyFrom(_batched(losses, np.float32))
    return bytes(out.SerializeToString())


# ------------------------------------------------------------------------------------------- sample

_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def sample_response(
    sequences: Sequence[tuple[Sequence[int], Sequence[float] | None, str]],
    prompt_logprobs: np.ndarray | None = None,
) -> bytes:
    """SampleResponse: per sequence (tokens, logprobs or None, stop reason "stop" | "length"); prompt
    log-probs float32 with NaN where none was computed."""
    out = pb.SampleResponse()
    for tokens, lps, reason in sequences:
        seq = out.sequences.add()
        seq.stop_reason = _STOP[reason]
        seq.tokens = np.asarray(tokens, np.int32).tobytes()
        if lps is not None:
            seq.logprobs = np.asarray(lps, np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return bytes(out.SerializeToString())
