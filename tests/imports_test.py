"""The package's import graph: drivers on top, libraries below, the CLI above all.

Read from the source (every import, module-level or inside a function), so no module needs to
be imported to check it: a library that reached up into a driver would fail here, not in a
review.
"""

import ast
import os

from bert_jax import task_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, 'bert_jax')
# The package's layers, top to bottom (README, "How the code is organised"): a module imports
# from its own layer and the layers below it only.
LAYERS = (
    ('entry points', {'__init__', 'cli', 'start_up', 'console', 'aot',
                      'hlo_kernels'}),
    ('drivers', {'train', 'finetune'}),
    ('commands that use a model', {'predict', 'features', 'fill_mask', 'export', 'serving'}),
    # The task modules are the table's (task_table.py imports none of them).
    ('fine-tuning tasks', {'task_table', 'metrics', *task_table.KINDS}),
    ('training', {'pretraining', 'train_state', 'state_extras', 'optim', 'sharding',
                  'monitor', 'trackers', 'run_frame'}),
    ('weights and checkpoints', {'publish', 'convert', 'pretrained', 'modernbert',
                                 'tensor_files', 'checkpoint', 'orbax_hooks', 'run_files',
                                 'run_lock'}),
    ('model', {'model', 'layers', 'attention', 'rotary', 'activations', 'fp8', 'layer_norm',
               'flops'}),
    ('data', {'input_pipeline', 'input_inspect', 'documents', 'pairing', 'masking', 'packing',
              'tokenization', 'vocab', 'sample_corpus', 'batching', 'tables'}),
    ('what is trained', {'objectives', 'tasks'}),
    ('foundations', {'config_files', 'config_checks', 'defaults', 'fileio', 'gcs', 'hub',
                     'errors'}),
)
# The drivers: one straight function each, from a config to a trained model.
DRIVERS = {'train', 'finetune'}
# What may import a driver: the command line only. The ahead-of-time compiler compiles the
# driver's exact train step through the library that builds it (pretraining.build_step).
DRIVER_USERS = {'cli'}


def _imports(path: str) -> set[str]:
  """The bert_jax modules that the Python file at `path` imports, anywhere in it."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read(), path)
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found |= {a.name.split('.')[1] for a in node.names if a.name.startswith('bert_jax.')}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == 'bert_jax':
        found |= {a.name for a in node.names}
      elif node.module.startswith('bert_jax.'):
        found.add(node.module.split('.')[1])
  return found


def _graph() -> dict[str, set[str]]:
  return {name[:-3]: _imports(os.path.join(PACKAGE, name))
          for name in sorted(os.listdir(PACKAGE)) if name.endswith('.py')}


def test_the_graph_is_read():
  graph = _graph()
  # What the checks below rely on: every module found, and imports of both kinds seen.
  assert DRIVERS | DRIVER_USERS <= set(graph)
  assert 'model' in graph['train'] and 'input_pipeline' in graph['train']  # One inside a def.
  assert 'train' in graph['cli'] and 'finetune' in graph['cli']


def test_every_module_has_a_layer_and_imports_only_from_it_and_below():
  layer_of = {module: i for i, (_, modules) in enumerate(LAYERS) for module in modules}
  graph = _graph()
  assert set(graph) == set(layer_of), ('place new modules in LAYERS (and the README table): '
                                       f'{sorted(set(graph) ^ set(layer_of))}')
  upward = sorted(f'{user} ({LAYERS[layer_of[user]][0]}) imports {used} '
                  f'({LAYERS[layer_of[used]][0]})'
                  for user, imported in graph.items() for used in imported
                  if layer_of[used] < layer_of[user])
  assert not upward, f'imports that point up: {upward}'


def test_only_the_cli_imports_a_driver():
  edges = sorted(f'{user} imports {driver}' for user, imported in _graph().items()
                 for driver in imported & DRIVERS if user not in DRIVER_USERS)
  assert not edges, ('libraries must not import a driver: move what they take into the '
                     f'library whose concern it is: {edges}')


def test_drivers_import_libraries_only():
  edges = sorted(f'{driver} imports {other}' for driver in DRIVERS
                 for other in _graph()[driver] & (DRIVERS | DRIVER_USERS) - {driver})
  assert not edges, f'a driver imports another driver or the CLI: {edges}'


def test_nothing_imports_the_cli():
  users = sorted(user for user, imported in _graph().items() if 'cli' in imported)
  assert not users, f'{users} import the CLI; config files load through config_files'


def test_shipped_configs_import_no_driver_and_not_the_cli():
  configs = os.path.join(ROOT, 'configs')
  imports = {name: _imports(os.path.join(configs, name))
             for name in sorted(os.listdir(configs)) if name.endswith('.py')}
  assert imports['bert_base_tpu_speed.py'] == {'config_files'}  # The one that loads a sibling.
  wrong = {name: sorted(found) for name, found in imports.items()
           if found & (DRIVERS | {'cli'})}
  assert not wrong, f'configs load through config_files and defaults, never the CLI: {wrong}'
