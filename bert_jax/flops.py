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

# NVIDIA GPUs for `bert-jax compile --topology=h100:8`: dense bf16 peak (no sparsity) and HBM
# bandwidth from NVIDIA's datasheets (H100 SXM5 and H200 SXM: 989 TFLOP/s; A100 SXM4 80GB: 312;
# B200 (HGX, 1,000 W): 2,250), then what XLA needs to compile for the chip without one:
# compute capability, multiprocessors, shared memory per multiprocessor and the most a block
# may opt into, L2, clock, and the device memory CUDA reports as total (a little under the
# nominal 80/141/80/180 GB). The H100's multiprocessors and L2 were read off one here (132, 50
# MiB); the rest is from NVIDIA's architecture whitepapers and XLA's GPU target specs.
GPU_CHIPS = {
    'h100': dict(name='NVIDIA H100 80GB HBM3', peak_flops=989e12, hbm_bandwidth=3.35e12,
                 hbm_bytes=84_942_979_072, compute_capability=(9, 0), cores=132,
                 shared_memory_per_core=228 * 2**10, shared_memory_per_block_optin=227 * 2**10,
                 l2_bytes=50 * 2**20, clock_ghz=1.98, fpus_per_core=128),
    'h200': dict(name='NVIDIA H200', peak_flops=989e12, hbm_bandwidth=4.8e12,
                 hbm_bytes=151_397_597_184, compute_capability=(9, 0), cores=132,
                 shared_memory_per_core=228 * 2**10, shared_memory_per_block_optin=227 * 2**10,
                 l2_bytes=50 * 2**20, clock_ghz=1.98, fpus_per_core=128),
    'a100': dict(name='NVIDIA A100-SXM4-80GB', peak_flops=312e12, hbm_bandwidth=2.039e12,
                 hbm_bytes=85_100_068_864, compute_capability=(8, 0), cores=108,
                 shared_memory_per_core=164 * 2**10, shared_memory_per_block_optin=163 * 2**10,
                 l2_bytes=40 * 2**20, clock_ghz=1.41, fpus_per_core=64),
    'b200': dict(name='NVIDIA B200', peak_flops=2250e12, hbm_bandwidth=8.0e12,
                 hbm_bytes=191_514_411_008, compute_capability=(10, 0), cores=148,
                 shared_memory_per_core=228 * 2**10, shared_memory_per_block_optin=227 * 2**10,
                 l2_bytes=126 * 2**20, clock_ghz=1.965, fpus_per_core=128),
}


def forward_flops_per_sequence(config: model_lib.BertConfig, seq_len: int,
                               num_predictions: int, with_nsp: bool = True) -> float:
  """Matmul FLOPs (2 x multiply-adds) of one sequence's forward pass. A gated MLP has two input
  matrices; a local layer's scores count the keys inside its window (at most W + 1), what a
  kernel that skips the rest (splash) computes."""
  h, i, t, v = config.hidden_size, config.intermediate_size, seq_len, config.vocab_size
  mlp_matrices = 3 if config.mlp_type == 'gated' else 2
  flops = 0
  for layer in range(config.num_hidden_layers):
    keys = min(t, config.local_attention_window + 1) if config.is_local_layer(layer) else t
    flops += (
        2 * t * h * 3 * h        # Q, K, V projections.
        + 2 * t * keys * h * 2   # Scores and the weighted sum of values.
        + 2 * t * h * h          # Attention output projection.
        + 2 * t * h * i * mlp_matrices)  # MLP in and out.
  flops += 2 * h * h                            # Pooler.
  flops += num_predictions * (2 * h * h + 2 * h * v)  # MLM transform and tied decoder.
  if with_nsp:
    flops += 2 * h * 2
  return float(flops)


def attention_flops_per_sequence(config: model_lib.BertConfig, seq_len: int) -> float:
  """Forward + backward FLOPs of the attention scores and weighted sums alone (what a fused
  attention kernel does, which XLA's cost analysis does not see into); local layers count
  their window's keys."""
  keys = sum(min(seq_len, config.local_attention_window + 1) if config.is_local_layer(i)
             else seq_len for i in range(config.num_hidden_layers))
  return 3.0 * keys * 2 * seq_len * config.hidden_size * 2


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
