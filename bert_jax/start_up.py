"""What a `bert-jax` command starts before it runs (`start`), in this order: TensorFlow (hiding
the accelerators from it starts its device platforms), jax.distributed (multi-host: before JAX's
backends), then JAX's backends, or for `compile` the target's platform (libtpu or JAX's CUDA
plugin); last, the freeze of what they loaded.

Their native start-up lines are held back (`console.native_stderr_held_back`) unless a bug
report wants them. `cli.py` calls `start` after the flags and the checks that need neither
TensorFlow nor JAX, so --help and such mistakes wait for none of it.
"""

import contextlib
import gc
import os
import sys

from absl import logging

from bert_jax import console
from bert_jax import fileio
from bert_jax.errors import UserError

# Commands that never load TensorFlow: `compile` reads only its config (a Python file) and
# compiles through JAX (packed rows excepted); loading TensorFlow would cost it about 4 s of CPU
# for nothing. `vocab` and `data` never start JAX.
_WITHOUT_TENSORFLOW = ('compile',)
_WITHOUT_JAX = ('vocab', 'data')

# `import tensorflow` loads Keras 3, which imports these when installed (Colab, the test extra);
# no command uses them: 0.9 s of CPU a start-up (README, CI). Keras catches their ImportError.
UNUSED_BY_TENSORFLOWS_IMPORT = ('IPython', 'matplotlib', 'pandas')


@contextlib.contextmanager
def without_unused_imports():
  """Inside, those of UNUSED_BY_TENSORFLOWS_IMPORT not loaded yet import as if not installed;
  afterwards each imports again."""
  blocked = [m for m in UNUSED_BY_TENSORFLOWS_IMPORT if m not in sys.modules]
  sys.modules.update(dict.fromkeys(blocked))  # Python's import answers None with ImportError.
  try:
    yield
  finally:
    for module in [m for m in blocked if sys.modules.get(m, False) is None]:
      del sys.modules[module]


def initialize_distributed(coordinator_address: str = '', num_processes: int = 0,
                           process_id: int = -1, mode: str = 'auto') -> None:
  """Starts jax.distributed when this is (or may be) one process of several."""
  import jax  # pylint: disable=g-import-not-at-top
  if mode == 'off':
    return
  explicit = bool(coordinator_address)
  slurm = int(os.environ.get('SLURM_NTASKS', '1')) > 1
  tpu_vm = os.path.exists('/dev/accel0') or bool(os.environ.get('TPU_WORKER_HOSTNAMES'))
  if not (mode == 'on' or explicit or slurm or tpu_vm):
    return
  kwargs = {}
  if explicit:
    if num_processes <= 0 or process_id < 0:
      raise UserError(f'--coordinator_address={coordinator_address} needs --num_processes (got '
                      f'{num_processes}) and --process_id (got {process_id}) too')
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id)
    if os.environ.get('JAX_PLATFORMS', '').startswith('cpu'):
      # CPU collectives across processes go over gloo (tests, laptops).
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(**kwargs)
  logging.info('jax.distributed: process %d of %d', jax.process_index(), jax.process_count())


def exit_now(status: int) -> None:
  """Ends the process with `status` without the interpreter's clean-up, which would abort a
  compile that SIGTERM left running on a worker thread (and the process, status 134).

  Where jax.distributed runs, it is shut down first (the one part of that clean-up that matters):
  its shutdown waits for every process. Process 0 runs the coordination service; left
  at once, it would take the service down under the processes still closing their run, and
  their agents would abort them (status -6 instead of `status`). A shutdown that fails (a peer
  gone) is logged, and the process leaves all the same."""
  jax = sys.modules.get('jax')
  try:
    if jax is not None and jax.distributed.is_initialized():
      jax.distributed.shutdown()
  except Exception as e:  # pylint: disable=broad-except  (a peer gone: leave all the same)
    logging.warning('jax.distributed did not shut down cleanly: %s', e)
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access


def start(command: str, quiet: bool, *, packed_compile: bool = False, topology: str = '',
          distributed: dict[str, str | int] | None = None) -> None:
  """Starts what `command` runs on (module docstring).

  Args:
    command: the subcommand (`pretrain`, `compile`, ...).
    quiet: hold back the native start-up lines (TensorFlow's oneDNN and cuInit notes; libtpu's
      block about the TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES it cannot find on a machine
      without a TPU, one line at error level), shown only if starting fails. Not quiet
      (--traceback, --verbosity=1 and up) they all show, for a bug report.
    packed_compile: `compile` of packed rows, which loads TensorFlow (packing.py).
    topology: `compile`'s --topology.
    distributed: the keyword arguments of `initialize_distributed`, for the commands that take
      its flags.
  """
  hold = console.native_stderr_held_back if quiet else contextlib.nullcontext
  if command not in _WITHOUT_TENSORFLOW or packed_compile:
    with hold(), without_unused_imports():
      # The pipeline's import loads TensorFlow Text too, whose notes are held back with it.
      from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top,unused-import
      fileio.hide_accelerators_from_tf()
  if distributed is not None:
    initialize_distributed(**distributed)
  if command == 'compile':
    from bert_jax import aot  # pylint: disable=g-import-not-at-top
    with hold():
      aot.target_devices(aot.parse_topology(topology))
  elif command not in _WITHOUT_JAX:
    import jax  # pylint: disable=g-import-not-at-top
    with hold():
      jax.devices()
  # The ~460,000 objects of the modules loaded so far (TensorFlow's, JAX's) live as long as the
  # process: out of the cyclic collector's sight (after one collection, which frees what the
  # start-up left), each of its full collections skips them (half of a short pre-training run's
  # 3.3 s of collections on a CPU). `cli.main(argv)` gives them back to it when it returns.
  gc.collect()
  gc.freeze()
