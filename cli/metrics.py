"""The step metrics of a run from its TensorBoard event files, for `rljob status`.

The trainer writes them (tensorboardX, tags `train/<metric>`) under the run's storage,
`{storage.root}/{namespace}/{name}/{uid}/tensorboard` (rljob.recipes.runconfig.StoragePaths.tensorboard),
so they outlive the pods; an attempt after a restart adds a file of its own. Event files are TFRecord
files (https://www.tensorflow.org/tutorials/load_data/tfrecord#tfrecords_format_details: a little-endian
uint64 length, its masked CRC-32C, the payload, the payload's masked CRC-32C) of `Event` protocol
buffers, parsed with tensorboardX's generated classes (no TensorBoard install needed). They are read
through the run storage layer (rljob.common.storage); gs:// needs google-cloud-storage (it finds
credentials as gcloud does; STORAGE_EMULATOR_HOST for the emulator).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

REWARD_TAG = "train/reward_mean"
EVENT_FILE = "events.out.tfevents."


class MetricsError(Exception):
    """Why the metrics cannot be read (one line)."""


def records(data: bytes) -> Iterator[bytes]:
    """The payloads of a TFRecord byte string; a truncated or corrupt tail (a file being written) ends it."""
    from tensorboardX.record_writer import masked_crc32c

    i = 0
    while i + 12 <= len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[i + 8 : i + 12])
        if crc != masked_crc32c(header) or i + 12 + n + 4 > len(data):
            return
        payload = data[i + 12 : i + 12 + n]
        (crc,) = struct.unpack("<I", data[i + 12 + n : i + 16 + n])
        if crc != masked_crc32c(payload):
            return
        yield payload
        i += 16 + n


def scalars(files: list[bytes]) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over event files (a later file's value of a step wins: a restarted attempt
    redoes the steps after its checkpoint)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for data in files:
        for payload in records(data):
            ev = event_pb2.Event.FromString(payload)
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[int(ev.step)] = float(v.simple_value)
    return out


def read_event_files(logdir: str) -> list[bytes]:
    """The event files directly under `logdir` (gs:// or a local directory), oldest name first."""
    from rljob.common.storage import open_store

    try:
        store = open_store(logdir)
    except ImportError:
        raise MetricsError(
            "reading gs:// needs google-cloud-storage (pip install 'rljob[trainer]')"
        ) from None
    return [data for key in store.list(EVENT_FILE) if (data := store.read(key)) is not None]


def profile_note(obj: dict[str, Any]) -> str:
    """Where the run's profiler traces go and which steps, when its MaxText keys ask for them (profiler:
    xplane; rljob.trainer.profiling), else ""."""
    from rljob.recipes import maxtext_policy
    from rljob.recipes.api import RLJob
    from rljob.recipes.plan import storage_paths
    from rljob.recipes.spec_layers import merged_spec

    try:
        job = RLJob.model_validate(
            {k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in obj}
        )
        merged, _, _ = merged_spec(job)
        keys = dict((merged.get("trainer") or {}).get("maxtext") or {})
        root = (merged.get("storage") or {}).get("root")
    except ValueError:
        return ""
    if str(keys.get("profiler") or "") != "xplane" or not root:
        return ""
    first = maxtext_policy.trainer_int(keys, "skip_first_n_steps_for_profiler", 1)
    count = maxtext_policy.trainer_int(keys, "profiler_steps", 5)
    paths = storage_paths(root, job)
    return (
        f"{paths.profile} (steps {first}..{first + count - 1}; TensorBoard's profile plugin or XProf: "
        f"tensorboard --logdir {paths.tensorboard})"
    )


def tensorboard_dir(obj: dict[str, Any]) -> str:
    """The run's event directory, from its spec and uid as the plan derives it."""
    from rljob.recipes.api import RLJob
    from rljob.recipes.plan import PlanError, storage_paths
    from rljob.recipes.spec_layers import merged_spec

    try:
        job = RLJob.model_validate(
            {k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in obj}
        )
        merged, _, problems = merged_spec(job)
        if problems:
            raise PlanError(problems)
        root = (merged.get("storage") or {}).get("root")
    except (PlanError, ValueError) as e:
        raise MetricsError(f"cannot derive its storage: {str(e).splitlines()[0]}") from None
    if not root:
        raise MetricsError("no spec.storage.root")
    path = storage_paths(root, job).tensorboard
    assert path
    return path


def reward_history(obj: dict[str, Any]) -> tuple[list[tuple[int, float]], str]:
    """(step, mean reward) pairs from the run's event files, and why there are none."""
    try:
        logdir = tensorboard_dir(obj)
        import tensorboardX  # noqa: F401  (the Event protos)
    except MetricsError as e:
        return [], str(e)
    except ImportError:
        return [], "reading TensorBoard events needs tensorboardX (pip install 'rljob[trainer]')"
    try:
        values = scalars(read_event_files(logdir)).get(REWARD_TAG, {})
    except MetricsError as e:
        return [], f"{logdir}: {e}"
    except Exception as e:  # storage errors (credentials, network): one line
        return [], f"{logdir}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not values:
        return [], f"no reward events under {logdir} yet"
    return sorted(values.items()), ""
