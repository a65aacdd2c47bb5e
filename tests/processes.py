"""What tests that start `bert-jax` subprocesses share: their environment and a free port."""

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env(cache_dir: str, devices: int | None = None) -> dict[str, str]:
  """A subprocess's environment: this checkout importable, a persistent compilation cache that
  later subprocesses reuse, and (when given) `devices` fake CPU devices, set before jax is
  imported."""
  out = dict(os.environ)
  out['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in [out.get('PYTHONPATH')] if p])
  out['JAX_COMPILATION_CACHE_DIR'] = cache_dir
  out['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  if devices is not None:
    out['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  return out


def free_port() -> int:
  """A loopback port for a subprocess's coordinator (free now; bound by the first process)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]
