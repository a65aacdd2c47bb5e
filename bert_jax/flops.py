"""Analytic FLOPs of a BERT training step and the peak FLOP/s of accelerators (for MFU)."""

import jax

from bert_jax import model as model_lib

# Dense bf16 peak FLOP/s per jax device, by `device_kind` substring (lowercase), the first
# match wins (so the specific names come first). TPU v2/v3 show each of a chip's two cores as a
# device: half the chip's peak; v4 and later are one device per chip.
PEAK_FLOPS = (
    ('b200', 2250e12), ('h200', 989e12), ('h100 pcie', 756e12), ('h100 nvl', 835e12),
    ('h100', 989e12), ('a100', 312e12), ('l40s', 362e12), ('l40', 181e12), ('l4', 121e12),
    ('a10', 125e12),
    ('v6 lite', 918e12), ('v6e', 918e12), ('v5 lite', 197e12), ('v5e', 197e12),
    ('v5p', 459e12), ('v5', 459e12), ('v4', 275e12), ('v3', 61.5e12), ('v2', 22.5e12),
)
# HBM bytes and bandwidth (bytes/s) per chip for the roofline of `bert-jax compile`.
TPU_CHIPS = {
    'v4': dict(peak_flops=275e12, hbm_bytes=32 * 2**30, hbm_bandwidth=1.2e12),
    'v5e': dict(peak_flops=197e12, hbm_bytes=16 * 2**30, hbm_bandwidth=0.82e12),
    'v5p': dict(peak_flops=459e12, hbm_bytes=95 * 2**30, hbm_bandwidth=2.765e12),
    'v6e': dict(peak_flops=918e12, hbm_bytes=32 * 2**30, hbm_bandwidth=1.64e12),
}


def forward_flops_per_sequence(config: model_lib.BertConfig, seq_len: int,
                               num_predictions: int, with_nsp: bool = True) -> float:
  """Matmul FLOPs (2 x multiply-adds) of one sequence's forward pass."""
  h, i, t, v = config.hidden_size, config.intermediate_size, seq_len, config.vocab_size
  per_layer = (
      2 * t * h * 3 * h        # Q, K, V projections.
      + 2 * t * t * h * 2      # Scores and the weighted sum of values.
      + 2 * t * h * h          # Attention output projection.
      + 2 * t * h * i * 2)     # MLP in and out.
  flops = config.num_hidden_layers * per_layer
  flops += 2 * h * h                            # Pooler.
  flops += num_predictions * (2 * h * h + 2 * h * v)  # MLM transform and tied decoder.
  if with_nsp:
    flops += 2 * h * 2
  return float(flops)


def train_flops_per_sequence(config: model_lib.BertConfig, seq_len: int,
                             num_predictions: int) -> float:
  """Forward + backward (2x forward) matmul FLOPs per sequence; rematerialization excluded."""
  return 3.0 * forward_flops_per_sequence(config, seq_len, num_predictions)


def peak_flops_per_device(device=None) -> float | None:
  """Dense bf16 peak of a device, or None where unknown (CPUs)."""
  device = device or jax.devices()[0]
  if device.platform == 'cpu':
    return None
  kind = device.device_kind.lower()
  for key, peak in PEAK_FLOPS:
    if key in kind:
      return peak
  return None
