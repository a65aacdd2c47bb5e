"""Ahead-of-time compilation of the train step for a Cloud TPU slice, on any machine.

`bert-jax compile --config=configs/bert_large.py --topology=v5e:16x16` lowers and compiles the
exact sharded train step of `train.py` against libtpu's description of the slice, then reports
per-chip memory against HBM and a roofline bound on the step time from XLA's cost analysis.

Two caveats of XLA's numbers are handled here: `optimal_seconds` is not usable (it comes back
negative), so the bound is computed from FLOPs and bytes; and the cost analysis counts the body
of a `lax.scan` once, so when the config scans its layers the costs come from a second compile
with the layers unrolled (same math, exact counts).
"""

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.experimental import topologies

from bert_jax import flops as flops_lib
from bert_jax import model as model_lib
from bert_jax import optim
from bert_jax import sharding as sharding_lib
from bert_jax import train as train_lib
from bert_jax import train_state as state_lib
from bert_jax.errors import UserError

# Accepted spellings of TPU generations -> libtpu's topology prefix and our chip table key.
_GENERATIONS = {'v4': ('v4', 'v4'), 'v5e': ('v5e', 'v5e'), 'v5litepod': ('v5e', 'v5e'),
                'v5p': ('v5p', 'v5p'), 'v6e': ('v6e', 'v6e')}


def parse_topology(name: str) -> tuple[str, str]:
  """'v5e:16x16' -> ('v5e:16x16', 'v5e'); errors name the flag."""
  gen, sep, shape = name.partition(':')
  if not sep or gen not in _GENERATIONS or not all(p.isdigit() for p in shape.split('x')):
    raise UserError(f'--topology={name!r}: expected GENERATION:SHAPE such as v5e:16x16, '
                    f'v4:2x2x4, v5p:4x4x4 or v6e:8x8 (generations: {sorted(_GENERATIONS)})')
  prefix, chip = _GENERATIONS[gen]
  return f'{prefix}:{shape}', chip


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


def _compile(config: ml_collections.ConfigDict, bert_config: model_lib.BertConfig, devices,
             seq_len: int, preds: int):
  mesh = sharding_lib.make_mesh(config.mesh, devices)
  rules = sharding_lib.rules_from_config(config.mesh)
  train_lib.check_batch(config, mesh)
  model = model_lib.BertForPreTraining(bert_config)
  tx, _ = optim.make_optimizer(config.train)
  abstract, shardings, _ = train_lib.abstract_state_and_shardings(model, tx, mesh, rules)
  step = train_lib.build_train_step(model, tx, mesh, rules, shardings,
                                    state_lib.dropout_rng(config.train),
                                    config.train.grad_accum_steps,
                                    config.data.objective)
  batch = _abstract_batch(config, seq_len, preds, sharding_lib.batch_sharding(mesh))
  with sharding_lib.activate(mesh, rules):
    lowered = step.jitted.lower(abstract, batch)
  return lowered.compile(), model_lib.count_params(abstract.params)


def compile_for_topology(config: ml_collections.ConfigDict, topology: str,
                         vocab_size: int = 30522) -> list[dict[str, Any]]:
  """Compiles the train step of every phase of `config` for `topology`; one report each."""
  topo_name, chip = parse_topology(topology)
  # Only compiling, never running: other processes with libtpu loaded (tests, a second
  # compile) are no contention, so skip libtpu's one-process lock.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  devices = topologies.get_topology_desc(platform='tpu', topology_name=topo_name).devices
  # Some descriptions (v4) list each TensorCore of a chip as a device: split the chip's HBM,
  # bandwidth and peak between them.
  chips = len({tuple(getattr(d, 'coords', (i,))) for i, d in enumerate(devices)})
  per_chip = len(devices) // max(chips, 1)
  hw = {k: v / per_chip for k, v in flops_lib.TPU_CHIPS[chip].items()}
  dtype = 'bfloat16' if config.model.dtype == 'auto' else config.model.dtype
  train_lib.check_attention(config, 'tpu')
  bert_config = train_lib.model_config(config, config.model.vocab_size or vocab_size)
  bert_config = bert_config.replace(dtype=dtype)
  reports = []
  mesh_sizes = dict(zip(sharding_lib.MESH_AXES,
                        sharding_lib.mesh_shape(config.mesh, len(devices))))
  for phase in train_lib.parse_phases(config):
    header = dict(topology=topology, chips=chips, devices=len(devices), chip=chip,
                  model=config.model.size, dtype=dtype, batch_size=config.train.batch_size,
                  seq_len=phase.seq_len, max_predictions=phase.max_predictions,
                  mesh=mesh_sizes, attention_impl=bert_config.attention_impl)
    try:
      compiled, n_params = _compile(config, bert_config, devices, phase.seq_len,
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
      costed, _ = _compile(config, bert_config.replace(scan_layers=False), devices,
                           phase.seq_len, phase.max_predictions)
    else:
      costed = compiled
    cost = costed.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    n = len(devices)
    xla_flops = float(cost['flops'])  # The partitioned program of one device.
    xla_bytes = float(cost.get('bytes accessed', 0.0))
    analytic = flops_lib.train_flops_per_sequence(
        bert_config, phase.seq_len,
        _row_predictions(config, phase.seq_len, phase.max_predictions)) * config.train.batch_size
    per_chip_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes +
                      mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    # XLA's cost analysis does not see inside a Pallas kernel (splash attention): the bound
    # then counts at least the analytic FLOPs, so that it stays a lower bound.
    pallas_calls = costed.as_text().count('custom_call_target="tpu_custom_call"')
    t_compute = max(xla_flops, analytic / n) / hw['peak_flops']
    t_memory = xla_bytes / hw['hbm_bandwidth']
    t_bound = max(t_compute, t_memory)
    tokens_per_chip = config.train.batch_size * phase.seq_len / t_bound / chips
    # Padded rows spend part of every step on padding, how much depends on the data; packed
    # rows are full but for the packer's few percent (`bert-jax data --stats`).
    real_tokens = dict(real_tokens_per_second_per_chip=tokens_per_chip) if config.data.packing \
        else {}
    reports.append(dict(
        header, params=n_params,
        memory=dict(arguments_gib=mem.argument_size_in_bytes / 2**30,
                    outputs_gib=mem.output_size_in_bytes / 2**30,
                    temporaries_gib=mem.temp_size_in_bytes / 2**30,
                    aliased_gib=mem.alias_size_in_bytes / 2**30,
                    total_gib=per_chip_bytes / 2**30, hbm_gib=hw['hbm_bytes'] / 2**30,
                    fits=per_chip_bytes <= hw['hbm_bytes']),
        flops=dict(xla_per_chip=xla_flops, xla_total=xla_flops * n, analytic_total=analytic,
                   xla_over_analytic=xla_flops * n / analytic,
                   counted_unrolled=bert_config.scan_layers, pallas_kernel_calls=pallas_calls),
        bytes_accessed_per_chip=xla_bytes,
        roofline_bound=dict(
            note='a lower bound on step time: max(FLOPs / peak, bytes / HBM bandwidth)',
            compute_seconds=t_compute, memory_seconds=t_memory, step_seconds=t_bound,
            sequences_per_second=config.train.batch_size / t_bound,
            tokens_per_second_per_chip=tokens_per_chip, **real_tokens,
            mfu=analytic / (t_bound * hw['peak_flops'] * n)),
    ))
  return reports


def format_report(report: dict[str, Any]) -> str:
  m = report['memory']
  title = (f"{report['model']} on {report['topology']} ({report['chips']} chips, "
           f"{report['devices']} devices), batch {report['batch_size']} x "
           f"{report['seq_len']} tokens, {report['dtype']}, mesh {report['mesh']}, "
           f"{report['attention_impl']} attention")
  if 'error' in m:
    return '\n'.join([
        title, f"  DOES NOT FIT in {m['hbm_gib']:.0f} GiB HBM per device: {m['error']}",
        '  Try model.remat_policy=dots or full, mesh.fsdp > 1, train.grad_accum_steps > 1, '
        'or a larger slice.', '  ' + json.dumps(report)])
  f, r = report['flops'], report['roofline_bound']
  rows = 'sequences'
  if 'real_tokens_per_second_per_chip' in r:
    rows = (f"packed rows, <= {r['real_tokens_per_second_per_chip']:.0f} real tokens/s per chip "
            '(packed rows are full but for the padding_fraction of bert-jax data --stats)')
  return '\n'.join([
      title,
      f"  memory per device: {m['total_gib']:.2f} GiB of {m['hbm_gib']:.0f} GiB HBM "
      f"({'fits' if m['fits'] else 'DOES NOT FIT'}): arguments {m['arguments_gib']:.2f}, "
      f"outputs {m['outputs_gib']:.2f}, temporaries {m['temporaries_gib']:.2f}, "
      f"donated {m['aliased_gib']:.2f}",
      f"  FLOPs per step: XLA {f['xla_total']:.4g}, analytic {f['analytic_total']:.4g} "
      f"(ratio {f['xla_over_analytic']:.3f}"
      + (f"; {f['pallas_kernel_calls']} Pallas kernel calls XLA cannot count inside"
         if f['pallas_kernel_calls'] else '') + ')',
      f"  roofline bound (not a measurement): step >= {r['step_seconds'] * 1e3:.1f} ms "
      f"(compute {r['compute_seconds'] * 1e3:.1f} ms, memory {r['memory_seconds'] * 1e3:.1f} "
      f"ms), <= {r['sequences_per_second']:.0f} {rows}, "
      f"<= {r['tokens_per_second_per_chip']:.0f} tokens/s per chip, MFU <= {r['mfu']:.1%}",
      '  ' + json.dumps(report),
  ])
