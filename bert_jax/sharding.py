"""Device mesh, logical-axis rules and the shardings of parameters, optimizer state and batches.

The model names every parameter and key activation with logical axes (vocab, embed, mlp, heads,
kv, layers, batch, length, act_*); `config.mesh.rules` maps them onto the mesh axes
('data', 'fsdp', 'tensor'). Data parallelism splits the batch over `data`; FSDP additionally
splits parameters and optimizer state over `fsdp` (the batch is split over both); tensor
parallelism splits heads, the MLP and the vocabulary over `tensor`.
"""

import contextlib
from typing import Any, Sequence

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bert_jax.errors import UserError

MESH_AXES = ('data', 'fsdp', 'tensor')
Rules = Sequence[tuple[str, Any]]


def mesh_shape(mesh_config: ml_collections.ConfigDict, num_devices: int) -> tuple[int, ...]:
  """Resolves the (data, fsdp, tensor) sizes; one of them may be -1 ("all the rest")."""
  sizes = [int(mesh_config[a]) for a in MESH_AXES]
  unknown = [a for a, s in zip(MESH_AXES, sizes) if s == -1]
  if len(unknown) > 1:
    raise UserError(f'only one of mesh.data/fsdp/tensor may be -1, got '
                    f'{dict(zip(MESH_AXES, sizes))}')
  if any(s == 0 or s < -1 for s in sizes):
    raise UserError(f'mesh sizes must be positive or -1, got {dict(zip(MESH_AXES, sizes))}')
  known = int(np.prod([s for s in sizes if s != -1]))
  if unknown:
    if num_devices % known:
      raise UserError(f'{num_devices} devices do not divide by the fixed mesh axes '
                      f'{dict(zip(MESH_AXES, sizes))}')
    sizes[sizes.index(-1)] = num_devices // known
  if int(np.prod(sizes)) != num_devices:
    raise UserError(f'mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, '
                    f'but {num_devices} are available; set mesh.data/fsdp/tensor (-1 = rest)')
  return tuple(sizes)


def make_mesh(mesh_config: ml_collections.ConfigDict, devices: Sequence[Any] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh laid out for the hardware topology."""
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(mesh_config, len(devices))
  try:
    # Puts tensor-parallel neighbours on the fastest links (ICI / NVLink).
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES)


def rules_from_config(mesh_config: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  rules = []
  for rule in mesh_config.rules:
    if len(rule) != 2:
      raise UserError(f'mesh.rules entries are (logical_axis, mesh_axes) pairs, got {rule!r}')
    name, target = rule
    targets = target if isinstance(target, (tuple, list)) else (target,)
    for t in targets:
      if t is not None and t not in MESH_AXES:
        raise UserError(f'mesh.rules: {name!r} maps to unknown mesh axis {t!r}; '
                        f'mesh axes are {MESH_AXES}')
    rules.append((name, tuple(target) if isinstance(target, list) else target))
  return tuple(rules)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules):
  """The mesh and logical-axis rules under which model code must be traced.

  Flax applies `nn.with_logical_constraint` (every activation constraint of the model) only
  when `jax.sharding.get_abstract_mesh()` is set. `jax.set_mesh` sets it; the old
  `with mesh:` context manager does not (jax >= 0.7), and under it every constraint is
  silently dropped, leaving all activation layouts to XLA's sharding propagation.
  """
  if hasattr(jax, 'set_mesh'):
    mesh_context = jax.set_mesh(mesh)
  elif hasattr(jax.sharding, 'use_mesh'):
    mesh_context = jax.sharding.use_mesh(mesh)
  else:
    mesh_context = mesh
  with mesh_context, nn.logical_axis_rules(rules):
    yield


# Where a parameter dimension's size comes from, for error messages.
_SIZE_KEYS = {
    'vocab': 'the vocabulary size (model.vocab_size may pad it to a multiple)',
    'embed': 'hidden_size (model.size)',
    'mlp': 'intermediate_size (model.size)',
    'heads': 'num_attention_heads (model.size)',
    'kv': 'the head size, hidden_size / num_attention_heads (model.size)',
    'layers': 'num_hidden_layers (model.size)',
}


def check_divisible(boxed_params: Any, mesh: Mesh, rules: Rules) -> None:
  """Raises a ValueError naming every parameter dimension its mesh axes do not divide.

  `boxed_params` is a (possibly abstract) tree of `nn.LogicallyPartitioned` leaves.
  """
  problems = []
  leaves = jax.tree_util.tree_leaves_with_path(
      boxed_params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  for path, leaf in leaves:
    if not isinstance(leaf, nn.LogicallyPartitioned):
      continue
    shape = leaf.value.shape
    spec = nn.logical_to_mesh_axes(leaf.names, rules)
    for dim, (logical, mesh_axes) in enumerate(zip(leaf.names, spec)):
      if mesh_axes is None:
        continue
      axes = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
      size = int(np.prod([mesh.shape[a] for a in axes]))
      if shape[dim] % size:
        name = '/'.join(str(getattr(k, 'key', k)) for k in path)
        where = ' x '.join(f'mesh.{a}={mesh.shape[a]}' for a in axes)
        problems.append(
            f'  {name} {tuple(shape)}: dimension {dim} ({logical!r}, size {shape[dim]}) is '
            f'split over {where} ({size} shards); set {", ".join(f"mesh.{a}" for a in axes)} '
            f'to a divisor of {shape[dim]} or change {_SIZE_KEYS.get(logical, logical)}')
  if problems:
    more = [f'  ... and {len(problems) - 8} more'] if len(problems) > 8 else []
    raise UserError('parameters do not divide over the mesh (config.mesh.rules maps their '
                    'logical axes onto it):\n' + '\n'.join(problems[:8] + more))


def logical_specs(boxed_tree: Any) -> Any:
  """PartitionSpecs of logical axis names for a tree of `nn.LogicallyPartitioned` leaves."""
  return nn.get_partition_spec(boxed_tree)


def to_mesh_shardings(specs: Any, mesh: Mesh, rules: Rules) -> Any:
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def opt_state_specs(tx: optax.GradientTransformation, abstract_opt_state: Any,
                    param_specs: Any) -> Any:
  """Optimizer state is sharded like the parameters it mirrors; its scalars are replicated."""
  return optax.tree_map_params(tx, lambda _, spec: spec, abstract_opt_state, param_specs,
                               transform_non_params=lambda _: P(),
                               is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches are split over the data-parallel axes (data and fsdp)."""
  return NamedSharding(mesh, P(('data', 'fsdp')))


def data_parallel_size(mesh: Mesh) -> int:
  return mesh.shape['data'] * mesh.shape['fsdp']


def check_batch_size(global_batch: int, mesh: Mesh, flag: str = 'train.batch_size') -> None:
  dp = data_parallel_size(mesh)
  if global_batch % dp or global_batch % jax.process_count():
    raise UserError(f'{flag}={global_batch} must divide over the {dp} data-parallel shards '
                    f'(mesh data x fsdp) and {jax.process_count()} processes')


def make_global_batch(local_batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict:
  """Host-local batches (this process's share) -> global jax.Arrays sharded over the batch."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in local_batch.items()}
