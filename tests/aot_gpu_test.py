"""Ahead-of-time compilation for NVIDIA GPUs from this CPU machine (no GPU, no driver).

The CUDA compiler comes from the gpuaot packages that the test extra installs (JAX's CUDA
plugin, ptxas, cuDNN). CI installs them, so there a missing plugin is a failure, not a skip.
"""

import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys

import pytest

from bert_jax import aot
from bert_jax import config_files
from bert_jax.errors import UserError

if importlib.util.find_spec('jax_plugins.xla_cuda12') is None and not os.environ.get('CI'):
  pytest.skip('the gpuaot extra (JAX CUDA plugin) is not installed', allow_module_level=True)


def _config(**overrides):
  base = {'model.size': 'tiny', 'model.vocab_size': 1024, 'train.batch_size': 16,
          'train.phases': '', 'data.max_seq_length': 128, 'data.max_predictions_per_seq': 20,
          'data.packing': True, 'model.attention_probs_dropout_prob': 0.0, 'mesh.data': -1}
  base.update(overrides)
  return config_files.load_config('configs/bert_base.py', base)


def test_gpu_topologies():
  assert aot.parse_topology('h100') == aot.Target('gpu', 'h100', '1x1x1')
  assert aot.parse_topology('a100:8') == aot.Target('gpu', 'a100', '1x1x8')
  assert aot.parse_topology('h200:2x8') == aot.Target('gpu', 'h200', '1x2x8')
  for bad in ('h100:0', 'h100:x8', 'h100:1x2x3', 'h300:8'):
    with pytest.raises(UserError, match='--topology'):
      aot.parse_topology(bad)


def test_packed_train_step_compiles_for_an_h100_with_cudnn_attention():
  """The packed BERT-tiny step, cuDNN's fused attention and XLA's: cuDNN's forward and
  backward calls are in the optimized program (one of each per layer), memory and FLOPs come
  back, and the two count the same work."""
  reports = {}
  for impl in ('cudnn', 'xla'):
    (r,) = aot.compile_for_topology(_config(**{'model.attention_impl': impl}), 'h100')
    assert r['platform'] == 'gpu' and r['chips'] == 1 and r['dtype'] == 'bfloat16'
    assert r['memory']['fits'] and 0 < r['memory']['total_gib'] < 1
    assert r['memory']['aliased_gib'] > 0  # The train state is donated.
    assert 1.0 <= r['flops']['xla_over_analytic'] < 1.5
    bound = r['roofline_bound']
    assert bound['step_seconds'] == max(bound['compute_seconds'], bound['memory_seconds']) > 0
    reports[impl] = r
  layers = 2  # BERT-tiny
  assert reports['cudnn']['flops']['cudnn_attention_calls'] == {'forward': layers,
                                                                'backward': layers}
  assert reports['xla']['flops']['cudnn_attention_calls'] == {'forward': 0, 'backward': 0}
  # model.layer_norm_impl='auto' compiles the fused Pallas LayerNorm for the GPU (through
  # Triton): one forward and one backward call per sub-layer, two sub-layers per layer.
  assert reports['xla']['flops']['pallas_kernel_calls'] == 2 * 2 * layers
  assert reports['cudnn']['flops']['xla_total'] == pytest.approx(
      reports['xla']['flops']['xla_total'], rel=0.05)
  assert 'cuDNN attention: 2 forward and 2 backward calls' in aot.format_report(reports['cudnn'])


def test_eight_gpus_with_fsdp():
  config = _config(**{'model.attention_impl': 'cudnn', 'mesh.data': 4, 'mesh.fsdp': 2})
  (r,) = aot.compile_for_topology(config, 'h100:8')
  assert (r['chips'], r['mesh']) == (8, {'data': 4, 'fsdp': 2, 'tensor': 1})
  assert r['flops']['cudnn_attention_calls']['forward'] == 2


def test_what_cudnn_cannot_run_is_a_clear_error_before_the_cluster():
  with pytest.raises(UserError, match='bfloat16 or float16'):
    aot.compile_for_topology(_config(**{'model.attention_impl': 'cudnn',
                                        'model.dtype': 'float32'}), 'h100')
  with pytest.raises(UserError, match='attention_probs_dropout_prob'):
    aot.compile_for_topology(_config(**{'model.attention_impl': 'cudnn',
                                        'model.attention_probs_dropout_prob': 0.1}), 'h100')
  with pytest.raises(UserError, match='runs on TPUs only'):
    aot.compile_for_topology(_config(**{'model.attention_impl': 'splash'}), 'h100')


def test_the_readme_install_line_and_compile_command_as_a_user_types_them(tmp_path):
  """The README's install line for the extra, run by the pip of a fresh virtual environment
  (Python's own: 23.2 on 3.11 and 3.12, which matched no extra spelt `gpu_aot` and installed
  nothing extra), then `bert-jax compile --topology=h100` from that environment's console script
  with the user's environment: no JAX_PLATFORMS or other variable of tests/conftest.py (the
  CUDA plugin's check of the CUDA libraries made it "topology not implemented for cuda").
  The environment sees this machine's packages (--system-site-packages), so pip resolves the
  extra without downloading it; the checkout is copied, so the editable install writes nothing
  into this one."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, 'README.md')) as f:
    line = re.search(r"`(python3 -m pip install -e '\.\[gpuaot\]')`", f.read()).group(1)
  checkout = tmp_path / 'bert_jax'
  checkout.mkdir()
  for name in ('bert_jax', 'configs'):
    shutil.copytree(os.path.join(root, name), checkout / name,
                    ignore=shutil.ignore_patterns('__pycache__'))
  for name in ('setup.cfg', 'pyproject.toml', 'README.md'):
    shutil.copy(os.path.join(root, name), checkout / name)
  venv = tmp_path / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--system-site-packages', str(venv)],
                 check=True)
  if sys.prefix != sys.base_prefix:  # Run from a virtual environment (.ci/run's current stack):
    # --system-site-packages shows the base Python's packages, not this one's; a .pth shows them.
    purelib = subprocess.run(
        [str(venv / 'bin' / 'python'), '-c',
         'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
        check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(purelib, 'test_parent_site.pth'), 'w') as f:
      f.write('\n'.join(site.getsitepackages()) + '\n')
  # The user's environment: none of the variables tests/conftest.py sets.
  env = {k: v for k, v in os.environ.items()
         if k not in ('JAX_PLATFORMS', 'XLA_FLAGS', 'JAX_DISABLE_MOST_OPTIMIZATIONS',
                      'TF_CPP_MIN_LOG_LEVEL', 'PYTHONPATH')}
  env['PATH'] = f'{venv / "bin"}{os.pathsep}{env["PATH"]}'
  install = subprocess.run(['bash', '-c', line], cwd=checkout, env=env, capture_output=True,
                           text=True, timeout=600)
  assert install.returncode == 0, install.stderr[-3000:]
  assert 'does not provide the extra' not in install.stdout + install.stderr, install.stderr
  overrides = {'model.size': 'tiny', 'model.vocab_size': 1024, 'train.batch_size': 16,
               'train.phases': '', 'data.max_seq_length': 128,
               'data.max_predictions_per_seq': 20, 'data.packing': True,
               'model.attention_impl': 'cudnn', 'model.attention_probs_dropout_prob': 0.0}
  compile_run = subprocess.run(
      [str(venv / 'bin' / 'bert-jax'), 'compile', '--config=bert_base', '--topology=h100'] +
      [f'--config.{k}={v}' for k, v in overrides.items()], cwd=tmp_path, env=env,
      capture_output=True, text=True, timeout=600)
  assert compile_run.returncode == 0, compile_run.stderr[-3000:]
  assert 'cuDNN attention: 2 forward and 2 backward calls' in compile_run.stdout, (
      compile_run.stdout)
  # The plugin's failed start (no cuFFT on this machine) is not shown above the report.
  assert 'Unable to load cuFFT' not in compile_run.stderr, compile_run.stderr[-3000:]
