"""Ahead-of-time compilation of the train step for a Cloud TPU slice or NVIDIA GPUs, anywhere.

`bert-jax compile --config=configs/bert_large.py --topology=v5e:16x16` lowers and compiles the
exact sharded train step that `train.py` runs (`pretraining.build_step`) against libtpu's
description of the slice, then reports per-chip memory against HBM and a roofline bound on
the step time from XLA's cost analysis. `--topology=h100:8` (h100, h200, a100, b200; `:N` GPUs
on one host, `:HxN` on H hosts) does the same for NVIDIA GPUs without one: XLA compiles for a
description of the GPU (`_gpu_target`) from a CPU-only machine, given the CUDA compiler
wheels of the `gpuaot` extra. The fused attention kernel follows the target
(`attention.lowering_for`), so `model.attention_impl=cudnn` compiles from a CPU host and its
cuDNN calls appear in the program.

Caveats of XLA's numbers, handled here: `optimal_seconds` is not usable (it comes back
negative), so the bound is computed from FLOPs and bytes; on a TPU its `bytes accessed` counts
on-chip memory traffic as well as HBM's, so the bound's bytes are counted from the optimized
program (`hbm_bytes`), never below the step's arguments read and results written once; the
cost analysis counts the body of a `lax.scan` once, so when the config scans its layers the
costs come from a second compile with the layers unrolled (same math, exact counts); it does
not see into fused kernels (cuDNN, Pallas), whose analytic FLOPs are added; and for GPU targets
`cost_analysis()` is empty, so the compiled module is costed by XLA's HLO cost analysis on the
host.
"""

import contextlib
import copy
import dataclasses
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.experimental import topologies
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from bert_jax import attention
from bert_jax import config_checks
from bert_jax import flops as flops_lib
from bert_jax import hlo_kernels
from bert_jax import model as model_lib
from bert_jax import pretraining
from bert_jax import sharding as sharding_lib
from bert_jax.errors import UserError

# Accepted spellings of TPU generations -> libtpu's topology prefix and our chip table key.
_GENERATIONS = {'v4': ('v4', 'v4'), 'v5e': ('v5e', 'v5e'), 'v5litepod': ('v5e', 'v5e'),
                'v5p': ('v5p', 'v5p'), 'v6e': ('v6e', 'v6e')}


@dataclasses.dataclass(frozen=True)
class Target:
  """What `--topology` names: a TPU slice or a set of NVIDIA GPUs."""
  platform: str      # 'tpu' or 'gpu' (attention.check_config's names).
  chip: str          # Key of flops.TPU_CHIPS or flops.GPU_CHIPS.
  topology: str      # The name jax.experimental.topologies takes.


def parse_topology(name: str) -> Target:
  """'v5e:16x16' -> a TPU slice; 'h100', 'h100:8', 'h100:2x8' -> 1, 8, 2 hosts x 8 GPUs."""
  gen, sep, shape = name.partition(':')
  dims = shape.split('x') if sep else []
  if gen in flops_lib.GPU_CHIPS:
    if dims and (len(dims) > 2 or not all(d.isdigit() and int(d) > 0 for d in dims)):
      raise UserError(f'--topology={name!r}: expected {gen}, {gen}:GPUS or {gen}:HOSTSxGPUS '
                      f'(e.g. {gen}:8 or {gen}:2x8)')
    hosts, gpus = ([1] + [int(d) for d in dims])[-2:] if dims else (1, 1)
    return Target('gpu', gen, f'1x{hosts}x{gpus}')
  if not sep or gen not in _GENERATIONS or not all(p.isdigit() for p in dims):
    raise UserError(f'--topology={name!r}: expected GENERATION:SHAPE for a TPU slice, such as '
                    f'v5e:16x16, v4:2x2x4, v5p:4x4x4 or v6e:8x8 (generations: '
                    f'{sorted(_GENERATIONS)}), or NVIDIA GPUs such as h100, h100:8 or h100:2x8 '
                    f'(GPUs: {sorted(flops_lib.GPU_CHIPS)})')
  prefix, chip = _GENERATIONS[gen]
  return Target('tpu', chip, f'{prefix}:{shape}')


def _gpu_target(chip: str) -> str:
  """XLA's description of an NVIDIA GPU (a stream_executor.GpuTargetConfigProto, text): what
  it compiles for when no GPU is present."""
  c = flops_lib.GPU_CHIPS[chip]
  major, minor = c['compute_capability']
  return '\n'.join([
      'gpu_device_info {',
      '  threads_per_block_limit: 1024', '  threads_per_warp: 32',
      '  shared_memory_per_block: 49152',
      f"  shared_memory_per_core: {c['shared_memory_per_core']}",
      '  threads_per_core_limit: 2048', f"  core_count: {c['cores']}",
      f"  fpus_per_core: {c['fpus_per_core']}",
      '  block_dim_limit_x: 2147483647', '  block_dim_limit_y: 65535',
      '  block_dim_limit_z: 65535',
      f"  memory_bandwidth: {int(c['hbm_bandwidth'])}", f"  l2_cache_size: {c['l2_bytes']}",
      f"  clock_rate_ghz: {c['clock_ghz']}", f"  device_memory_size: {c['hbm_bytes']}",
      f"  shared_memory_per_block_optin: {c['shared_memory_per_block_optin']}",
      f'  cuda_compute_capability {{ major: {major} minor: {minor} }}',
      '  registers_per_core_limit: 65536', '  registers_per_block_limit: 65536',
      '}',
      'platform_name: "CUDA"',
      # The cuDNN the compiled program will meet; 9.x has the fused attention kernels.
      'dnn_version_info { major: 9 minor: 8 patch: 0 }',
      f"device_description_str: \"{c['name']}\"",
  ])


def target_devices(target: Target) -> list:
  """The devices of a target's topology description (loads libtpu or JAX's CUDA plugin)."""
  if target.platform == 'tpu':
    # Only compiling, never running: other processes with libtpu loaded (tests, a second
    # compile) are no contention, so skip libtpu's one-process lock.
    os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
    try:
      return topologies.get_topology_desc(platform='tpu',
                                          topology_name=target.topology).devices
    except jax.errors.JaxRuntimeError as e:
      if 'INVALID_ARGUMENT' not in str(e):
        raise
      # A shape libtpu has no slice of ("v5e:3x5": not a whole number of hosts).
      reason = str(e).split('INVALID_ARGUMENT:', 1)[1].strip().splitlines()[0][:300]
      raise UserError(f'--topology={target.topology}: not a TPU slice libtpu knows ({reason}); '
                      'name a slice such as v5e:2x2, v5e:4x4, v5e:16x16, v4:2x2x4 or '
                      'v5p:4x4x4') from None
  try:
    return topologies.get_topology_desc(platform='cuda', target_config=_gpu_target(target.chip),
                                        topology=target.topology).devices
  except Exception as e:  # pylint: disable=broad-except
    if 'cuda' not in str(e).lower() and 'not found' not in str(e).lower():
      raise
    raise UserError('compiling for NVIDIA GPUs needs the CUDA compiler of the gpuaot extra: '
                    "pip install -e '.[gpuaot]' in the checkout (JAX's CUDA plugin, ptxas, "
                    f'cuDNN; no GPU or driver needed); JAX said: {str(e).splitlines()[0][:200]}'
                    ) from None


def _row_predictions(config: ml_collections.ConfigDict, seq_len: int, preds: int) -> int:
  """Width of the batch's masked_lm_* features: a packed row holds several sequences'."""
  if not config.data.packing:
    return preds
  from bert_jax import packing  # pylint: disable=g-import-not-at-top  (TensorFlow)
  return packing.predictions_per_row(preds, int(config.data.packing_max_sequences), seq_len)


def _abstract_batch(config: ml_collections.ConfigDict, seq_len: int, preds: int,
                    sharding) -> dict:
  """The batch `input_pipeline` makes for a phase: rows of one sequence, or packed rows."""
  batch_size = config.train.batch_size
  spec = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  batch = dict(input_ids=spec((batch_size, seq_len)), input_mask=spec((batch_size, seq_len)),
               segment_ids=spec((batch_size, seq_len)))
  preds = _row_predictions(config, seq_len, preds)
  if config.data.packing:
    per_row = int(config.data.packing_max_sequences)
    batch.update(position_ids=spec((batch_size, seq_len)),
                 sequence_ids=spec((batch_size, seq_len)),
                 next_sentence_positions=spec((batch_size, per_row)),
                 next_sentence_labels=spec((batch_size, per_row)),
                 next_sentence_weights=spec((batch_size, per_row), jnp.float32))
  else:
    batch.update(next_sentence_labels=spec((batch_size,)))
  batch.update(masked_lm_positions=spec((batch_size, preds)),
               masked_lm_ids=spec((batch_size, preds)),
               masked_lm_weights=spec((batch_size, preds), jnp.float32))
  return batch


def _compile(config: ml_collections.ConfigDict, vocab_size: int, devices, seq_len: int,
             preds: int):
  """The train step of `pretraining.build_step`, the one the driver runs, compiled."""
  mesh = sharding_lib.make_mesh(config.mesh, devices)
  rules = sharding_lib.rules_from_config(config.mesh)
  pretraining.check_batch(config, mesh)
  batch = _abstract_batch(config, seq_len, preds, sharding_lib.batch_sharding(mesh))
  platform = 'gpu' if devices[0].platform in ('gpu', 'cuda') else devices[0].platform
  capability = attention.compute_capability(devices[0]) if platform == 'gpu' else None
  with attention.lowering_for(platform, capability):
    # Built for the target: the model config's 'auto' resolves for it (`model.resolve`).
    built = pretraining.build_step(config, mesh, vocab_size)
    with sharding_lib.activate(mesh, rules):
      lowered = built.train_step.jitted.lower(built.abstract, batch)
  # Compiled without a GPU, nothing can be timed, so XLA's autotuners only assign their
  # default configurations; level 0 assigns the same ones without the search around them (the
  # same kernels, bytes and memory at BERT-base/128 and BERT-large/512 on jax 0.10 and 0.12,
  # and a BERT-base/128 compile 31 -> 26 s on 0.12).
  options = {'xla_gpu_autotune_level': 0} if platform == 'gpu' else None
  with _without_persistent_cache():
    compiled = lowered.compile(compiler_options=options)
  return compiled, model_lib.count_params(built.abstract.params)


@contextlib.contextmanager
def _without_persistent_cache():
  """JAX's persistent compilation cache off. XLA cannot load a deviceless executable back
  ("PjRtCompiler must be constructed with a Client"), so a cache the user configured
  (JAX_COMPILATION_CACHE_DIR, say) would only collect entries that warn when read again."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  jax_cache.reset_cache()  # JAX decides once per process whether the cache is used.
  try:
    yield
  finally:
    jax.config.update('jax_enable_compilation_cache', enabled)
    jax_cache.reset_cache()


def _cost(compiled, platform: str) -> dict[str, float]:
  """XLA's cost analysis of the compiled program of one device."""
  if platform == 'gpu':
    # Empty for a GPU target compiled without one: cost the optimized module on the host.
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
    module = compiled.runtime_executable().hlo_modules()[0]
    return _jax.hlo_module_cost_analysis(xla_bridge.get_backend('cpu'), module)
  cost = compiled.cost_analysis()
  return cost[0] if isinstance(cost, (list, tuple)) else cost


# ---- HBM traffic --------------------------------------------------------------------------
# XLA's `bytes accessed` is not HBM traffic on a TPU: it adds the operands and results of every
# operation whatever memory they live in (on-chip VMEM included), and counts an async copy or
# slice into VMEM by its whole (source, destination) tuple. For BERT-large at one sequence per
# v5e chip it gave ~310 GB a step where the step's arrays are ~8 GB. The bound counts instead
# what each operation of the optimized program reads from and writes to HBM (memory space 0).

_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2, 'f32': 4,
                's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}
_ARRAY = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([0-9,]*)\](\{[^}]*\})?')
_INSTRUCTION = re.compile(r'\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*?)\)(?:, |$)')
# Operations that move no data (they name buffers), or whose data moved at their *-start.
_NO_TRAFFIC = frozenset({'tuple', 'get-tuple-element', 'parameter', 'constant', 'bitcast',
                         'after-all', 'partition-id', 'replica-id', 'copy-done', 'slice-done',
                         'all-gather-done', 'all-reduce-done', 'collective-permute-done'})


def _arrays(shape: str) -> list[tuple[int, bool]]:
  """(bytes, in HBM) of each array of an HLO shape; `S(n)` with n > 0 is on-chip memory."""
  out = []
  for dtype, dims, layout in _ARRAY.findall(shape):
    size = _DTYPE_BYTES[dtype]
    for d in filter(None, dims.split(',')):
      size *= int(d)
    space = re.search(r'S\((\d+)\)', layout or '')
    out.append((size, not space or space.group(1) == '0'))
  return out


_FUSED = re.compile(r'^%?([\w.\-]+) \(')  # The first line of a (fused) computation.
_CALLS = re.compile(r'\bcalls=%?([\w.\-]+)')


def _roots(hlo_text: str) -> dict[str, str]:
  """{computation: the opcode of its root} of every computation of an HLO module."""
  out, name = {}, None
  for line in hlo_text.split('\n'):
    if name is None:
      found = _FUSED.match(line)
      if found and line.rstrip().endswith('{'):
        name = found.group(1)
      continue
    if line.rstrip() == '}':  # (An instruction's attributes may span lines starting '}}'.)
      name = None
    elif line.lstrip().startswith('ROOT ') and (match := _INSTRUCTION.match(line)):
      out[name] = match.group(3)
  return out


def _in_place_updates(hlo_text: str) -> dict[str, tuple[int, int]]:
  """{fused computation: (operand updated in place, bytes of the update)} of the fused
  computations whose root is a dynamic-update-slice of one of their parameters.

  Such a fusion writes its update into that operand's buffer: XLA's copy insertion gives the
  result the operand's buffer (the buffer assignment shows one allocation for both) or adds a
  `copy` of its own, counted where it stands. It moves the update, not the whole buffer: the
  grouped gradient norm's `optimizer/stack` writes each layer's gradient into an f32[24, ...]
  stack so, and counting the whole stack read and written by each of the 24 took BERT-large's
  count at one sequence per v5e chip from about 16 to 54 GB."""
  out, name, params, shapes = {}, None, {}, {}
  for line in hlo_text.split('\n'):
    if name is None:
      found = _FUSED.match(line)
      if found and line.rstrip().endswith('{'):
        name, params, shapes = found.group(1), {}, {}
      continue
    if line.rstrip() == '}':
      name = None
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    inst, shape, op, operands = match.groups()
    shapes[inst] = shape
    if op == 'parameter':
      params[inst] = int(operands)
    elif op == 'dynamic-update-slice' and line.lstrip().startswith('ROOT '):
      target, update = [o.strip().lstrip('%') for o in operands.split(',')[:2]]
      if target in params:
        out[name] = (params[target], sum(size for size, _ in _arrays(shapes.get(update, ''))))
  return out


def hbm_bytes(hlo_text: str) -> float:
  """Bytes the entry computation of an optimized HLO module moves to and from HBM: each
  operation's operands and results that live in HBM, an async copy's HBM side once, an async
  slice's HBM read of the slice (not of its whole source), and a dynamic-update-slice (alone
  or as the root of a fusion: `_in_place_updates`) its update read and written in place (not
  its whole operand and result)."""
  entry, lines = False, []
  for line in hlo_text.split('\n'):
    if line.startswith('ENTRY '):
      entry = True
    elif entry and line.rstrip() == '}':
      # Its end. (A Mosaic kernel's backend_config spans lines, some starting '}}': taken for
      # the end, they cut the count of a step with splash attention to a sixth.)
      break
    elif entry:
      lines.append(line)
  in_place, roots = _in_place_updates(hlo_text), _roots(hlo_text)
  shapes, total = {}, 0
  for line in lines:
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, shape, op, operands = match.groups()
    shapes[name] = shape
    if op in _NO_TRAFFIC:
      continue
    if op == 'copy-start':  # (source, destination, context): what of them is in HBM.
      total += sum(size for size, hbm in _arrays(shape)[:2] if hbm)
      continue
    operand_arrays = [a for o in operands.split(',') if o.strip().startswith('%')
                      for a in _arrays(shapes.get(o.strip()[1:], ''))]
    called = _CALLS.search(line)
    if op == 'async-done':
      continue  # What it holds moved at its async-start.
    if op == 'slice-start' or (op == 'async-start' and called and
                               roots.get(called.group(1)) == 'slice'):
      # ((source), slice, context): the slice is what is read. (libtpu 0.0.42 prints an async
      # slice as an `async-start` of a computation whose root is the slice.)
      size, slice_in_hbm = _arrays(shape)[-2]
      total += size * (all(hbm for _, hbm in operand_arrays) + slice_in_hbm)
      continue
    names = [o.strip()[1:] for o in operands.split(',') if o.strip().startswith('%')]
    if op == 'dynamic-update-slice' or (op == 'fusion' and called and
                                        called.group(1) in in_place):
      # In place: the other operands read, the update written into the buffer it updates.
      target, update = ((0, sum(s for s, _ in _arrays(shapes.get(names[1], ''))))
                        if op == 'dynamic-update-slice' else in_place[called.group(1)])
      result_in_hbm = all(hbm for _, hbm in _arrays(shape))
      total += update * result_in_hbm + sum(
          size for i, o in enumerate(names) if i != target
          for size, hbm in _arrays(shapes.get(o, '')) if hbm)
      continue
    total += sum(size for size, hbm in operand_arrays + _arrays(shape) if hbm)
  return float(total)


def compile_for_topology(config: ml_collections.ConfigDict, topology: str,
                         vocab_size: int = 30522) -> list[dict[str, Any]]:
  """Compiles the train step of every phase of `config` for `topology`; one report each."""
  config_checks.check_config(config, kind='pretrain')
  target = parse_topology(topology)
  chip = target.chip
  pretraining.check_attention(config, target.platform)
  devices = target_devices(target)
  if target.platform == 'gpu':
    hw = {k: flops_lib.GPU_CHIPS[chip][k] for k in ('peak_flops', 'hbm_bytes', 'hbm_bandwidth')}
    chips = len(devices)
  else:
    # Some descriptions (v4) list each TensorCore of a chip as a device: split the chip's HBM,
    # bandwidth and peak between them.
    chips = len({tuple(getattr(d, 'coords', (i,))) for i, d in enumerate(devices)})
    per_chip = len(devices) // max(chips, 1)
    hw = {k: v / per_chip for k, v in flops_lib.TPU_CHIPS[chip].items()}
  vocab_size = config.model.vocab_size or vocab_size
  # 'auto' resolved for the accelerator, not this host (`_compile` builds the step for it too).
  bert_config = model_lib.config_from(config.model, vocab_size=vocab_size,
                                     platform=target.platform)
  dtype = bert_config.dtype
  reports = []
  mesh_sizes = dict(zip(sharding_lib.MESH_AXES,
                        sharding_lib.mesh_shape(config.mesh, len(devices))))
  for phase in pretraining.parse_phases(config):
    header = dict(topology=topology, platform=target.platform, chips=chips,
                  devices=len(devices), chip=chip,
                  model=config.model.size, dtype=dtype, batch_size=config.train.batch_size,
                  seq_len=phase.seq_len, max_predictions=phase.max_predictions,
                  mesh=mesh_sizes, attention_impl=bert_config.attention_impl,
                  layer_norm_impl=bert_config.layer_norm_impl)
    try:
      compiled, n_params = _compile(config, vocab_size, devices, phase.seq_len,
                                    phase.max_predictions)
    except jax.errors.JaxRuntimeError as e:
      if 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      # XLA refuses to compile a program that cannot fit: that is the answer asked for.
      reports.append(dict(header, memory=dict(fits=False, hbm_gib=hw['hbm_bytes'] / 2**30,
                                              error=str(e).splitlines()[0])))
      continue
    mem = compiled.memory_analysis()
    if bert_config.scan_layers:
      unscanned = copy.deepcopy(config)
      unscanned.model.scan_layers = False
      costed, _ = _compile(unscanned, vocab_size, devices, phase.seq_len, phase.max_predictions)
    else:
      costed = compiled
    cost = _cost(costed, target.platform)
    n = len(devices)
    xla_flops = float(cost['flops'])  # The partitioned program of one device.
    # Gradient accumulation runs the micro-batches in a loop whose body the cost analysis
    # counts once (as a scan's): its count is one micro-batch's, scaled here to the step's.
    accum = int(config.train.grad_accum_steps)
    xla_bytes = float(cost.get('bytes accessed', 0.0))
    # The step reads each of its arguments and writes each of its results at least once.
    min_bytes = float(mem.argument_size_in_bytes + mem.output_size_in_bytes)
    hbm = hbm_bytes(costed.as_text()) if target.platform == 'tpu' else xla_bytes
    analytic = flops_lib.train_flops_per_sequence(
        bert_config, phase.seq_len,
        _row_predictions(config, phase.seq_len, phase.max_predictions)) * config.train.batch_size
    per_chip_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes +
                      mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    text = costed.as_text()
    # XLA's cost analysis does not see inside a Pallas kernel (splash attention on TPUs; the
    # fused LayerNorm on GPUs, lowered through Triton): the bound then counts at least the
    # analytic FLOPs, so that it stays a lower bound.
    pallas_calls = (text.count('custom_call_target="tpu_custom_call"') +
                    text.count('custom_call_target="__gpu$xla.gpu.triton"'))
    # Nor inside cuDNN's fused attention (__cudnn$fmhaScaleBiasSoftmax with a mask), whose calls
    # it counts as 0 FLOPs: theirs are added.
    cudnn_calls = {'forward': len(re.findall(r'custom_call_target="__cudnn\$fmha\w*Softmax"',
                                             text)),
                   'backward': len(re.findall(
                       r'custom_call_target="__cudnn\$fmha\w*SoftmaxBackward"', text))}
    if cudnn_calls['forward']:
      xla_flops += flops_lib.attention_flops_per_sequence(
          bert_config, phase.seq_len) * config.train.batch_size / n
    t_compute = max(xla_flops * accum, analytic / n) / hw['peak_flops']
    t_memory = max(hbm, min_bytes) / hw['hbm_bandwidth']
    t_bound = max(t_compute, t_memory)
    tokens_per_chip = config.train.batch_size * phase.seq_len / t_bound / chips
    # Padded rows spend part of every step on padding, how much depends on the data; packed
    # rows are full but for the packer's few percent (`bert-jax data --stats`).
    real_tokens = dict(real_tokens_per_second_per_chip=tokens_per_chip) if config.data.packing \
        else {}
    # A GPU program's kernels by what they compute, the bytes its non-matmul kernels move and
    # the patterns the step budget keeps out (tests/aot_gpu_test.py); of the unrolled program
    # when the layers are scanned, so that every layer's launches count.
    kernels = dict(kernels=hlo_kernels.step_budget(text)) if target.platform == 'gpu' else {}
    reports.append(dict(
        header, params=n_params, **kernels,
        memory=dict(arguments_gib=mem.argument_size_in_bytes / 2**30,
                    outputs_gib=mem.output_size_in_bytes / 2**30,
                    temporaries_gib=mem.temp_size_in_bytes / 2**30,
                    aliased_gib=mem.alias_size_in_bytes / 2**30,
                    total_gib=per_chip_bytes / 2**30, hbm_gib=hw['hbm_bytes'] / 2**30,
                    fits=per_chip_bytes <= hw['hbm_bytes']),
        flops=dict(xla_per_chip=xla_flops, xla_total=xla_flops * n, analytic_total=analytic,
                   micro_batches=accum, xla_over_analytic=xla_flops * n * accum / analytic,
                   counted_unrolled=bert_config.scan_layers, pallas_kernel_calls=pallas_calls,
                   cudnn_attention_calls=cudnn_calls,
                   cudnn_attention_flops_added=bool(cudnn_calls['forward'])),
        hbm_bytes_per_chip=dict(
            counted=hbm, minimum=min_bytes, xla_bytes_accessed=xla_bytes,
            note=('counted: what the optimized program\'s operations move to and from HBM '
                  '(on a GPU target, XLA\'s bytes accessed); minimum: every argument read and '
                  'every result written once; xla_bytes_accessed: XLA\'s count, which on a TPU '
                  'includes on-chip memory traffic')),
        roofline_bound=dict(
            note='a lower bound on step time: max(FLOPs / peak, HBM bytes / HBM bandwidth)',
            compute_seconds=t_compute, memory_seconds=t_memory, step_seconds=t_bound,
            sequences_per_second=config.train.batch_size / t_bound,
            tokens_per_second_per_chip=tokens_per_chip, **real_tokens,
            mfu=analytic / (t_bound * hw['peak_flops'] * n)),
    ))
  return reports


def format_report(report: dict[str, Any]) -> str:
  m = report['memory']
  where = (f"{report['chips']} GPUs" if report.get('platform') == 'gpu' else
           f"{report['chips']} chips, {report['devices']} devices")
  title = (f"{report['model']} on {report['topology']} ({where}), batch {report['batch_size']} x "
           f"{report['seq_len']} tokens, {report['dtype']}, mesh {report['mesh']}, "
           f"{report['attention_impl']} attention, {report['layer_norm_impl']} LayerNorm")
  if 'error' in m:
    return '\n'.join([
        title, f"  DOES NOT FIT in {m['hbm_gib']:.0f} GiB HBM per device: {m['error']}",
        '  Try model.remat_policy=dots or full, mesh.fsdp > 1, train.grad_accum_steps > 1, '
        'or a larger slice.', '  ' + json.dumps(report)])
  f, r, h = report['flops'], report['roofline_bound'], report['hbm_bytes_per_chip']
  rows = 'sequences'
  if 'real_tokens_per_second_per_chip' in r:
    rows = (f"packed rows, <= {r['real_tokens_per_second_per_chip']:.0f} real tokens/s per chip "
            '(packed rows are full but for the padding_fraction of bert-jax data --stats)')
  return '\n'.join([
      title,
      f"  memory per device: {m['total_gib']:.2f} GiB of {m['hbm_gib']:.0f} GiB HBM "
      f"({'fits' if m['fits'] else 'DOES NOT FIT'}"
      + ('' if report.get('platform') != 'gpu' else
         "; JAX takes 75% of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says more")
      + f"): arguments {m['arguments_gib']:.2f}, "
      f"outputs {m['outputs_gib']:.2f}, temporaries {m['temporaries_gib']:.2f}, "
      f"donated {m['aliased_gib']:.2f}",
      f"  FLOPs per step: XLA {f['xla_total']:.4g}"
      + (f" for one of the {f['micro_batches']} micro-batches (the accumulation loop's body, "
         f"which XLA counts once; x{f['micro_batches']}: "
         f"{f['xla_total'] * f['micro_batches']:.4g})" if f.get('micro_batches', 1) > 1 else '')
      + f", analytic {f['analytic_total']:.4g} (ratio {f['xla_over_analytic']:.3f}"
      + (f"; {f['pallas_kernel_calls']} Pallas kernel calls XLA cannot count inside"
         if f['pallas_kernel_calls'] else '')
      + ("; cuDNN attention: {forward} forward and {backward} backward calls, their analytic "
         'FLOPs added'.format(**f['cudnn_attention_calls'])
         if f.get('cudnn_attention_flops_added') else '') + ')',
      f"  HBM traffic per device and step: {h['counted'] / 1e9:.2f} GB (at least "
      f"{h['minimum'] / 1e9:.2f} GB: each argument read and each result written once)",
      *([] if 'kernels' not in report else [
          f"  kernels per step: {report['kernels']['kernels']} ("
          + ', '.join(f'{g} {n}' for g, n in report['kernels']['kernels_by_group'].items())
          + f"); non-matmul kernels move {report['kernels']['non_matmul_bytes'] / 1e9:.2f} GB "
          '(operands + results, hlo_kernels.step_budget)'
          + (f"; {report['kernels']['fp8_matmuls']} FP8 GEMMs"
             if report['kernels'].get('fp8_matmuls') else '')]),
      f"  roofline bound (not a measurement): step >= {r['step_seconds'] * 1e3:.1f} ms "
      f"(compute {r['compute_seconds'] * 1e3:.1f} ms, memory {r['memory_seconds'] * 1e3:.1f} "
      f"ms), <= {r['sequences_per_second']:.0f} {rows}, "
      f"<= {r['tokens_per_second_per_chip']:.0f} tokens/s per chip, MFU <= {r['mfu']:.1%}",
      '  ' + json.dumps(report),
  ])
