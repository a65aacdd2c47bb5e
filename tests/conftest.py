"""Test session setup: importable checkout, 8 fake CPU devices, fast compiles.

These variables must be set before jax is imported, which is why they live here.
"""
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()
# Compile time dominates the tiny models of most tests; modules whose runs take many steps opt
# out (OPTIMIZE_XLA, below).
os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')
# TensorFlow's Cloud Storage file system reads its retry budget when TensorFlow is imported: a
# test cannot shorten it for its own process later. The faults the tests inject come at most 2
# in a row; on TensorFlow's default budget (1 s doubling) each one that TensorFlow met slept 1-2
# s (gcs_test's fine-tuning through faults, in this process: 108 s, 67 s on the short budget).
# A user's shell (processes.user_env) keeps the defaults.
import processes  # pylint: disable=g-import-not-at-top,wrong-import-position
for _name, _value in processes.SHORT_GCS_RETRIES.items():
  os.environ.setdefault(_name, _value)


import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

# The cyclic collector every 20,000 allocations net instead of 700 (its youngest generation), in
# the test workers and (tests/forkserver.py) the commands forked for them: the default ran
# about 2,800 collections in a worker's tiny pre-training test, 3.6 s of its 47 s of CPU (1.0 s
# with this), and 1.3 s of a forked 8-step run's 27 s (0.55 s). What the tests run and check is
# the same; only when cyclic garbage is freed moves.
import forkserver  # pylint: disable=g-import-not-at-top,wrong-import-position
gc.set_threshold(*forkserver.GC_THRESHOLD)


@pytest.fixture(scope='session', autouse=True)
def without_grappler():
  """TensorFlow's graph optimizer (Grappler) off in each process that runs tests.

  Each new iterator optimizes the input pipeline's functions (the tokenizer, the pairs, the
  masking) again: about 0.3 s each, 3 s of CPU of a 29 s tiny pre-training run (3 runs each,
  alternating, 2026-11-30), where the tests make some hundred runs. What the optimized
  functions compute is the same (the run's losses, bit for bit); what they buy is throughput
  (benchmarks/input_pipeline.py: 7-12% more tokens/s), which no test measures. bert_jax itself
  keeps it, and so do the commands a test starts (fresh or forked, tests/forkserver.py): the
  README's longer runs, forked with it off, took 7-10% more CPU (readme_test, two runs each,
  alternating). A fixture, not pytest_configure: its set-up captures TensorFlow's start-up lines.
  Set after TensorFlow's runtime started, the option holds for the iterators made later."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})


def pytest_sessionfinish(session):  # pylint: disable=unused-argument
  """Collects garbage once and freezes what survives, so pytest's five collections at exit (to
  report unraisable exceptions) skip the millions of JAX and TensorFlow objects still alive.
  They took several seconds, and execnet interrupts a test worker still busy 5 s after the run
  (a KeyboardInterrupt in jax's gc callback, reported as a warning)."""
  gc.collect()
  gc.freeze()


@pytest.fixture(scope='module', autouse=True)
def xla_optimizations(request):
  """XLA's optimizations for a module that sets `OPTIMIZE_XLA = True`, in this process and the
  subprocesses it starts meanwhile (their environment): its runs take enough steps, each about
  eight times slower unoptimized on CPU, to outweigh the slower compiles (train_test: about a
  third less time). Every run of such a module compiles alike, so their losses compare
  exactly."""
  if not getattr(request.module, 'OPTIMIZE_XLA', False):
    yield
    return
  import jax  # pylint: disable=g-import-not-at-top
  previous = jax.config.read('jax_disable_most_optimizations')
  previous_env = os.environ.get('JAX_DISABLE_MOST_OPTIMIZATIONS')
  jax.config.update('jax_disable_most_optimizations', False)
  os.environ['JAX_DISABLE_MOST_OPTIMIZATIONS'] = '0'
  yield
  jax.config.update('jax_disable_most_optimizations', previous)
  if previous_env is None:
    os.environ.pop('JAX_DISABLE_MOST_OPTIMIZATIONS', None)
  else:
    os.environ['JAX_DISABLE_MOST_OPTIMIZATIONS'] = previous_env


@pytest.fixture(scope='module')
def compilation_cache(tmp_path_factory):
  """A persistent compilation cache (its path) for a module's runs, every program kept: set in
  this process while the module runs (restored afterwards), handed to its subprocesses with
  `processes.env`. Runs of one configuration in several workdirs then compile once; a run's
  own cache (checkpoint.compilation_cache_dir) gives way to one set outside bert_jax."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache as cc  # pylint: disable=g-import-not-at-top
  path = str(tmp_path_factory.mktemp('jax_cache'))
  settings = {'jax_compilation_cache_dir': path,
              'jax_persistent_cache_min_compile_time_secs': 0.0,
              'jax_persistent_cache_min_entry_size_bytes': 0}
  previous = {name: getattr(jax.config, name) for name in settings}
  for name, value in settings.items():
    jax.config.update(name, value)
  cc.reset_cache()
  yield path
  for name, value in previous.items():
    jax.config.update(name, value)
  cc.reset_cache()


@pytest.fixture(scope='module')
def gcs(tmp_path_factory):
  """A Cloud Storage server on loopback with one bucket (tests/gcs_server.py), stopped after
  the module that uses it. Its client settings (https_proxy among them) are in this process's
  environment meanwhile, and only then."""
  import gcs_server  # pylint: disable=g-import-not-at-top
  server = gcs_server.GcsServer(str(tmp_path_factory.mktemp('gcs')))
  try:
    server.start()
  except RuntimeError as e:  # A missing binary fails the tests that need it: never a skip.
    server.stop()
    pytest.fail(f'Cloud Storage test server: {e}', pytrace=False)
  from bert_jax import gcs as gcs_lib  # pylint: disable=g-import-not-at-top
  saved = {k: os.environ.get(k) for k in server.env}
  os.environ.update(server.env)
  # google-cloud-storage's client, made once per process, keeps the server it was made for: a
  # worker that comes back to a module (--dist worksteal) after another, or to another module
  # with a server, would still call the stopped one.
  gcs_lib.client.cache_clear()
  yield server
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  gcs_lib.client.cache_clear()
  server.stop()
