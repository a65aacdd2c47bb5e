"""Tests of bert_jax.console: what a command shows on the console besides its output. The
commands as users run them (held-back start-up lines, signals) are cli_test.py's."""

import logging
import os
import sys

import pytest

from bert_jax import console


@pytest.mark.parametrize('driver', [False, True])
def test_the_cuda_plugins_failed_start_is_held_back_without_a_driver(monkeypatch, driver):
  """With the gpuaot extra on a CPU machine, JAX logs its CUDA plugin's failed start (no cuFFT)
  with two tracebacks before every command: held back unless an NVIDIA driver is there, where
  it matters."""
  try:
    raise RuntimeError('Unable to load cuFFT. Is it installed?')
  except RuntimeError:
    exc_info = sys.exc_info()
  # As jax._src.xla_bridge logs it (logger.exception).
  record = logging.getLogger('jax._src.xla_bridge').makeRecord(
      'jax._src.xla_bridge', logging.ERROR, 'xla_bridge.py', 510,
      'Jax plugin configuration error: Exception when calling %s.initialize()',
      ('jax_plugins.xla_cuda12',), exc_info)
  real_exists = os.path.exists
  monkeypatch.setattr(os.path, 'exists',
                      lambda p: driver if p == '/dev/nvidiactl' else real_exists(p))
  assert console.ours_or_a_warning(record) == driver
  other = logging.getLogger('jax._src.xla_bridge').makeRecord(
      'jax._src.xla_bridge', logging.ERROR, 'xla_bridge.py', 1, 'another error', (), None)
  assert console.ours_or_a_warning(other)
