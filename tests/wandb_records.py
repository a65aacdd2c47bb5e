"""What an offline W&B run wrote, read back from its run-ID.wandb file without a W&B server.

wandb 0.31 has no public Python reader of its run files (the old `wandb.sdk.internal.datastore`
moved into the wandb-core binary), so the tests read the format themselves: a 7-byte header
(':W&B', a magic number, a version), then LevelDB's log format (32 KiB blocks of records, each a
7-byte header: CRC-32C, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) whose payloads are
`wandb.proto.wandb_internal_pb2.Record` messages, wandb's own protocol buffers.
"""

import dataclasses
import glob
import json
import os
import struct
import time

_HEADER = 7
_BLOCK = 32 * 1024


@dataclasses.dataclass
class OfflineRun:
  path: str
  run_id: str
  project: str
  config: dict  # key -> value (wandb's own `_wandb` key left out).
  history: list[dict]  # One dict per logged step: {'_step': ..., tag: value}.
  finished: bool = False  # Its exit record is written (`run.finish()`).


def _records(data: bytes) -> list[bytes]:
  out, pending, pos = [], b'', _HEADER
  while pos + 7 <= len(data):
    left = _BLOCK - pos % _BLOCK
    if left < 7:  # A block's tail too short for a header is padding.
      pos += left
      continue
    _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
    payload = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind == 0 and length == 0:
      break
    if kind == 1:
      out.append(payload)
    elif kind == 2:
      pending = payload
    elif kind == 3:
      pending += payload
    elif kind == 4:
      out.append(pending + payload)
      pending = b''
  return out


def read(path: str) -> OfflineRun:
  """The run, config and history records of one run-ID.wandb file."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    data = f.read()
  assert data[:4] == b':W&B', f'{path}: not a W&B run file'
  run = OfflineRun(path, '', '', {}, [])
  for payload in _records(data):
    record = wandb_internal_pb2.Record()
    record.ParseFromString(payload)
    kind = record.WhichOneof('record_type')
    if kind == 'run':
      run.run_id, run.project = record.run.run_id, record.run.project
      updates = record.run.config.update
    elif kind == 'exit':
      run.finished = True
      continue
    elif kind == 'config':
      updates = record.config.update
    elif kind == 'history':
      row = {}
      for item in record.history.item:
        key = item.key or '/'.join(item.nested_key)
        row[key] = json.loads(item.value_json)
      run.history.append(row)
      continue
    else:
      continue
    for item in updates:
      key = item.key or '/'.join(item.nested_key)
      if key != '_wandb':
        run.config[key] = json.loads(item.value_json)
  return run


def _started(path: str) -> tuple[str, int]:
  """When the run of a run file started: wandb names its folder offline-run-<second it
  started>-<run ID>, and a later start of that run in the same second <...>-<run ID>-1, -2, ...
  (which plain sorting puts first: '-' comes before '/')."""
  folder = os.path.basename(os.path.dirname(path))
  run_id = os.path.basename(path)[len('run-'):-len('.wandb')]
  stamp, _, rest = folder[len('offline-run-'):].partition('-')
  assert rest.startswith(run_id), f'{path}: not in a folder wandb names'
  return stamp, int(rest[len(run_id):].lstrip('-') or 0)


def offline_runs(folder: str, timeout: float = 60) -> list[OfflineRun]:
  """Every offline run under `folder`/wandb, oldest first, once each is finished: wandb-core
  may still be writing a run's file after `finish()`."""
  paths = sorted(glob.glob(os.path.join(folder, 'wandb', 'offline-run-*', 'run-*.wandb')),
                 key=_started)
  deadline = time.monotonic() + timeout
  while True:
    runs = [read(p) for p in paths]
    if all(r.finished for r in runs) or time.monotonic() > deadline:
      return runs
    time.sleep(0.5)
