"""Peak FLOP/s lookup (for MFU) and the analytic FLOPs of a step."""

import types

import pytest

from bert_jax import flops
from bert_jax import model as model_lib


@pytest.mark.parametrize('kind,peak', [
    ('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA H100 PCIe', 756e12), ('NVIDIA H100 NVL', 835e12),
    ('NVIDIA H200', 989e12), ('NVIDIA A100-SXM4-40GB', 312e12), ('NVIDIA L4', 121e12),
    ('NVIDIA L40S', 362e12), ('NVIDIA L40', 181e12), ('TPU v3', 61.5e12), ('TPU v4', 275e12),
    ('TPU v5 lite', 197e12), ('TPU v5p', 459e12), ('TPU v6 lite', 918e12)])
def test_peak_flops_of_device_kinds(kind, peak):
  device = types.SimpleNamespace(platform='gpu' if 'NVIDIA' in kind else 'tpu', device_kind=kind)
  assert flops.peak_flops_per_device(device) == peak


def test_cpu_has_no_peak():
  cpu = types.SimpleNamespace(platform='cpu', device_kind='cpu')
  assert flops.peak_flops_per_device(cpu) is None


def test_bert_base_step_flops_by_hand():
  config = model_lib.config_for_size('base')
  h, t, p, v = 768, 128, 20, 30522
  per_layer = 24 * t * h * h + 4 * t * t * h   # QKV, output, MLP (4h); scores and values.
  forward = 12 * per_layer + 2 * h * h + p * (2 * h * h + 2 * h * v) + 4 * h
  assert flops.train_flops_per_sequence(config, t, p) == 3 * forward
