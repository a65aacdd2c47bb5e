"""The benchmark scripts run end to end on tiny settings and print the JSON they promise.

No figure is checked (speed is measured by running them, never by timed tests); this keeps them
from breaking silently when the package they drive changes.
"""

import json
import os
import subprocess
import sys

import pytest

import processes


@pytest.mark.parametrize('script, args, keys', [
    ('train_step.py', ['--size=tiny', '--batch_size=4', '--seq_len=32', '--steps=2',
                       '--warmup=1', '--real_data'],
     {'sequences_per_second', 'step_seconds', 'loss', 'input_wait_fraction'}),
    ('packing.py', ['--what=padding', '--seq_lens=128', '--batches=2'],
     {'padded_padding_fraction', 'packed_padding_fraction', 'packed_sequences_per_row'}),
    ('finetune_buckets.py', ['--num_examples=64', '--batch_size=16', '--max_seq_length=32',
                             '--buckets=16,32', '--vocab_size=100', '--rounds=1'],
     {'padding', 'fixed', 'bucketed', 'speedup'}),
])
def test_benchmark_prints_json(tmp_path, script, args, keys):
  proc = subprocess.run([sys.executable, os.path.join(processes.ROOT, 'benchmarks', script)] +
                        args, cwd=tmp_path, env=processes.env(str(tmp_path / 'jax_cache'), 1),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{')]
  assert rows, proc.stdout[-3000:]
  assert keys <= set(rows[-1]), rows[-1]
