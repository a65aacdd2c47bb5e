"""Test session setup: importable checkout, 8 fake CPU devices, fast compiles.

These variables must be set before jax is imported, which is why they live here.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()
# Compile time dominates the tiny models of the tests.
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')


import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope='session')
def gcs(tmp_path_factory):
  """A Cloud Storage server on loopback with one bucket (tests/gcs_server.py), stopped at the
  end of the session. Its client settings are in this process's environment meanwhile."""
  import gcs_server  # pylint: disable=g-import-not-at-top
  server = gcs_server.GcsServer(str(tmp_path_factory.mktemp('gcs')))
  try:
    server.start()
  except RuntimeError as e:  # A missing binary fails the tests that need it: never a skip.
    server.stop()
    pytest.fail(f'Cloud Storage test server: {e}', pytrace=False)
  saved = {k: os.environ.get(k) for k in server.env}
  os.environ.update(server.env)
  yield server
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  server.stop()
