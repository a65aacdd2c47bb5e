"""A serving user's process: loads SavedModels and calls their signatures with TensorFlow only.

  python3 -I -S serving_client.py REQUESTS.json RESULTS.json SITE_PACKAGES...

Run isolated (-I: no PYTHONPATH, no current folder; -S: no site-packages but the folders
given, TensorFlow's): JAX, Flax and bert_jax are installed beside TensorFlow here, so an import
hook refuses them, and RESULTS.json records that importing each failed and that none was
loaded by the end. REQUESTS.json: [{"export": folder, "signature": name, "inputs": {name:
nested lists of strings}}, ...]; RESULTS.json: {"blocked": {module: error}, "loaded": [...],
"outputs": [{name: nested lists}, ...]} (bytes decoded as UTF-8).
"""

import importlib.abc
import json
import sys

BLOCKED = ('jax', 'jaxlib', 'flax', 'optax', 'orbax', 'bert_jax')


class _Refuse(importlib.abc.MetaPathFinder):
  """Makes `import jax` (and the others, and their submodules) fail as if not installed."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname.split('.')[0] in BLOCKED:
      raise ModuleNotFoundError(f'No module named {fullname!r} (blocked: TensorFlow only)')
    return None


def _plain(value):
  if isinstance(value, bytes):
    return value.decode('utf-8')
  if isinstance(value, list):
    return [_plain(v) for v in value]
  return value


def main(requests_path, results_path, site_packages):
  sys.meta_path.insert(0, _Refuse())
  sys.path.extend(site_packages)
  blocked = {}
  for name in BLOCKED:
    try:
      __import__(name)
      blocked[name] = None
    except ImportError as e:
      blocked[name] = str(e)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_text  # pylint: disable=g-import-not-at-top,unused-import  (its ops)
  with open(requests_path, encoding='utf-8') as f:
    requests = json.load(f)
  models, outputs = {}, []
  for request in requests:
    if request['export'] not in models:
      models[request['export']] = tf.saved_model.load(request['export'])
    signature = models[request['export']].signatures[request['signature']]
    inputs = {k: tf.constant(v, tf.string) for k, v in request['inputs'].items()}
    outputs.append({k: _plain(v.numpy().tolist()) for k, v in signature(**inputs).items()})
  loaded = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)
  with open(results_path, 'w', encoding='utf-8') as f:
    json.dump({'blocked': blocked, 'loaded': loaded, 'outputs': outputs}, f)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2], sys.argv[3:])
