"""Ahead-of-time compilation for NVIDIA GPUs from this CPU machine (no GPU, no driver).

The CUDA compiler comes from the gpu_aot packages that the test extra installs (JAX's CUDA
plugin, ptxas, cuDNN). CI installs them, so there a missing plugin is a failure, not a skip.
"""

import importlib.util
import os

import pytest

from bert_jax import aot
from bert_jax import config_files
from bert_jax.errors import UserError

if importlib.util.find_spec('jax_plugins.xla_cuda12') is None and not os.environ.get('CI'):
  pytest.skip('the gpu_aot extra (JAX CUDA plugin) is not installed', allow_module_level=True)


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
