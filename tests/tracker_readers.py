"""Read a run directory's experiment trackers back, offline, each with its own reader (tests/test_tracking.py).

W&B: wandb 0.31 ships no Python reader for the offline transaction log
(<dir>/wandb/offline-run-<YYYYMMDD_HHMMSS>-<id>/run-<id>.wandb), so `wandb_run` parses its framing here and
decodes each record with wandb's own protobuf schema (wandb.proto.wandb_internal_pb2.Record). The framing,
checked against files wandb 0.31.0 wrote: a 7-byte header (b":W&B", uint16 0xBEE1 little-endian, uint8
version 0), then LevelDB log chunks in 32 KiB blocks counted from the file's first byte (the header sits in
the first block): a 7-byte chunk header (checksum uint32, length uint16, type uint8: 1 full, 2 first,
3 middle, 4 last) and the payload; a block tail shorter than 7 bytes is zero padding. The checksum is the
IEEE CRC-32 (zlib.crc32) of the type byte and the payload, unmasked (not LevelDB's masked CRC-32C).
TensorBoard: its EventAccumulator (scalars and histograms as stored) and, for text, plugin_event_accumulator
(what `tensorboard --load_fast=false` serves). MLflow: MlflowClient on the run directory's SQLite store.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7  # both the file header and a chunk header


def wandb_log_records(path: Path) -> list:
    """The records of one W&B transaction log, in order (wandb_internal_pb2.Record). Raises ValueError for a
    file that is not one, a chunk whose checksum fails, or a record cut off (a truncated file)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B" or struct.unpack_from("<HB", data, 4) != (0xBEE1, 0):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    records, pending, pos = [], None, HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a header never straddles blocks: the tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, pos)
        payload = data[pos + HEADER: pos + HEADER + length]
        if len(payload) != length or checksum != zlib.crc32(bytes([kind]) + payload):
            raise ValueError(f"{path}: bad chunk at byte {pos} (type {kind}, length {length})")
        pos += HEADER + length
        if (kind in (1, 2)) != (pending is None) or kind not in (1, 2, 3, 4):  # a record starts only after the last ended
            raise ValueError(f"{path}: chunk type {kind} at byte {pos - HEADER - length} out of order")
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = None
    if pending is not None:
        raise ValueError(f"{path}: the last record is cut off")
    return records


@dataclass
class WandbRun:
    """What a run directory's W&B offline logs hold, over every offline-run-* directory in time order.

    run_ids: the run id of each directory (a resumed run: the same id again); steps: history steps in the
    order written (a step sent twice appears twice); history: step -> {key: value} (a histogram as W&B's
    {"_type": "histogram", "values": counts, "bins": edges}; a table as W&B's table-file object plus the
    "columns" and "data" of its file); config: the run's config (the last value of each key); summary."""

    run_ids: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    history: dict[int, dict] = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def wandb_run(run_dir: Path) -> WandbRun:
    """Read <run_dir>/wandb/offline-run-*/run-<id>.wandb (see the module docstring). Raises ValueError for a
    damaged log, FileNotFoundError when there is none."""
    dirs = sorted(Path(run_dir).glob("wandb/offline-run-*"))  # the name's timestamp orders them
    if not dirs:
        raise FileNotFoundError(f"no wandb/offline-run-* in {run_dir}")
    out = WandbRun()
    for d in dirs:
        (log,) = d.glob("run-*.wandb")
        for record in wandb_log_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out.run_ids.append(record.run.run_id)
                _update(out.config, record.run.config.update)
            elif kind == "config":
                _update(out.config, record.config.update)
            elif kind == "summary":
                _update(out.summary, record.summary.update)
            elif kind == "history":
                row: dict = {}
                _update(row, record.history.item)
                for value in row.values():
                    if isinstance(value, dict) and value.get("_type") == "table-file":
                        value.update(json.loads((d / "files" / value["path"]).read_text()))
                out.steps.append(record.history.step.num)
                out.history[record.history.step.num] = row
    return out


def _update(target: dict, items) -> None:
    """Apply W&B items (key or nested_key, value_json) to the nested dict `target`."""
    for item in items:
        path = [item.key] if item.key else list(item.nested_key)
        node = target
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = json.loads(item.value_json)


def _accumulator(log_dir: Path):
    """TensorBoard's (legacy) EventAccumulator over every event file in `log_dir`, keeping every event."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(
        str(log_dir), size_guidance=dict.fromkeys(event_accumulator.DEFAULT_SIZE_GUIDANCE, 0))  # 0: keep all
    acc.Reload()
    return acc


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in the order TensorBoard shows them (float32 values, as stored)."""
    acc = _accumulator(log_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_histograms(log_dir: Path) -> dict[str, list[tuple[int, dict]]]:
    """tag -> [(step, {min, max, num, sum, sum_squares, bucket_limit, bucket})]."""
    acc = _accumulator(log_dir)
    return {tag: [(e.step, dataclasses.asdict(e.histogram_value)) for e in acc.Histograms(tag)] for tag in acc.Tags()["histograms"]}


def tensorboard_texts(log_dir: Path) -> dict[str, list[tuple[int, str]]]:
    """tag (as stored: SummaryWriter.add_text appends "/text_summary") -> [(step, text)], as TensorBoard's text
    plugin reads them: through plugin_event_accumulator, whose restart purge covers text too (the legacy
    EventAccumulator above purges scalars and histograms only)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.util import tensor_util

    acc = plugin_event_accumulator.EventAccumulator(
        str(log_dir), size_guidance=plugin_event_accumulator.STORE_EVERYTHING_SIZE_GUIDANCE)
    acc.Reload()
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)]
            for tag in acc.PluginTagToContent("text")}


@dataclass
class MlflowRun:
    """An MLflow run as its client reads it. metrics: key -> [(step, value)] (every value logged, by step);
    artifacts: path under the run's artifact root -> its JSON content (histograms/, trajectories/, config.json)."""

    run_id: str
    experiment_id: str
    status: str
    metrics: dict[str, list[tuple[int, float]]]
    params: dict[str, str]
    tags: dict[str, str]
    artifacts: dict[str, object]


def mlflow_run(run_dir: Path, run_id: str, db: Path | None = None) -> MlflowRun:
    """Read run `run_id` from sqlite:///<run_dir>/mlflow.db (or the SQLite file `db`) with MlflowClient."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{Path(db or Path(run_dir) / 'mlflow.db').resolve()}")
    run = client.get_run(run_id)
    metrics = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}
    artifacts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for folder in ("histograms", "trajectories", None):
            for info in client.list_artifacts(run_id, folder):
                if not info.is_dir:
                    artifacts[info.path] = json.loads(Path(client.download_artifacts(run_id, info.path, tmp)).read_text())
    return MlflowRun(run_id, run.info.experiment_id, run.info.status, metrics, dict(run.data.params), dict(run.data.tags),
                     artifacts)
