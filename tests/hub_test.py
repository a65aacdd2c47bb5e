"""hf:// names: checkpoints pulled from a Hub on loopback (tests/hub_server.py) through
huggingface_hub's own download code into a real Hub cache, then read from that cache with
HF_HUB_OFFLINE=1; the pulled model is the local folder, bit for bit; every failure is one line.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from bert_jax import convert
from bert_jax import features
from bert_jax import hub
from bert_jax import model as model_lib
from bert_jax import pretrained
from bert_jax.errors import UserError
import hub_server

huggingface_hub = pytest.importorskip('huggingface_hub')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ['the', 'movie', 'was', 'good', 'bad', 'plot', 'an', 'awful', 'story', 'and', 'it', '.']
VOCAB = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + WORDS
CONFIG = model_lib.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=64)
NAME = 'bert-jax-test/tiny-bert'


def _export(root, name: str, seed: int) -> str:
  """A tiny BERT as `bert-jax convert --format=hf` writes it: root/name."""
  vocab = root / 'vocab.txt'
  vocab.write_text('\n'.join(VOCAB) + '\n')
  params = model_lib.init_params(CONFIG, jax.random.key(seed))
  ours = str(root / f'{name}_bert_jax')
  convert.export_bert_jax(CONFIG, params, ours, vocab_file=str(vocab), lower_case=True)
  convert.convert(ours, str(root / name), 'hf')
  return str(root / name)


def _files(folder: str, prefix: str = '') -> dict[str, bytes]:
  out = {}
  for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name), 'rb') as f:
      out[prefix + name] = f.read()
  return out


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  """The fake Hub with: NAME (main, and the tag v1 on an older commit of other weights), a
  private copy, a model in a folder, a GPT-2 config and a repository without a model."""
  root = tmp_path_factory.mktemp('hub')
  main, v1 = _export(root, 'main', 0), _export(root, 'v1', 1)
  with hub_server.HubServer() as hub_:
    hub_.add_repo(NAME, _files(v1), message='v1')
    repo = hub_.repos[('model', NAME)]
    repo.tags['v1'] = repo.branches['main']
    hub_.add_repo(NAME, {**_files(main), 'README.md': b'# tiny\n',
                         'onnx/model.onnx': b'not fetched'}, message='main')
    hub_.add_repo('bert-jax-test/private-bert', _files(main), private=True)
    hub_.add_repo('bert-jax-test/models', _files(main, 'tiny/'))
    hub_.add_repo('bert-jax-test/gpt', {'config.json': b'{"model_type": "gpt2"}',
                                        'model.safetensors': b'x'})
    hub_.add_repo('bert-jax-test/notes', {'README.md': b'nothing here'})
    yield {'hub': hub_, 'root': root, 'main': main, 'v1': v1, 'home': root / 'hf_home'}


def _use(monkeypatch, server, offline: bool = False, endpoint: str | None = None) -> None:
  """huggingface_hub pointed at the fake Hub (or `endpoint`) and the test's cache. Its
  constants are read from the environment at import, so they are set as the import left them."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  endpoint = endpoint or server['hub'].url
  monkeypatch.setattr(constants, 'ENDPOINT', endpoint)
  monkeypatch.setattr(constants, 'HUGGINGFACE_CO_URL_TEMPLATE',
                      endpoint + '/{repo_id}/resolve/{revision}/{filename}')
  monkeypatch.setattr(constants, 'HF_HUB_CACHE', str(server['home'] / 'hub'))
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', offline)
  monkeypatch.delenv('HF_TOKEN', raising=False)
  monkeypatch.setattr(hub, '_FOLDERS', {})


@pytest.fixture
def online(server, monkeypatch):
  _use(monkeypatch, server)
  return server


def _assert_same_params(a: dict, b: dict) -> None:
  flat_a, flat_b = pretrained.flatten(a), pretrained.flatten(b)
  assert sorted(flat_a) == sorted(flat_b)
  for path, x in flat_a.items():
    np.testing.assert_array_equal(x, flat_b[path], err_msg=path)


def _outputs(config, params) -> list[np.ndarray]:
  ids = np.array([[2, 5, 6, 7, 3, 0], [2, 9, 10, 3, 11, 3]], np.int32)
  mask = (ids > 0).astype(np.int32)
  segments = np.array([[0] * 6, [0, 0, 0, 0, 1, 1]], np.int32)
  return [np.asarray(x) for x in model_lib.encode(config, params, ids, mask, segments)]


def test_parse_names():
  assert hub.parse('hf://org/bert', 'f') == hub.HubName('model', 'org/bert', None, '')
  assert hub.parse('hf://org/bert@step-100/sub/dir', 'f') == hub.HubName(
      'model', 'org/bert', 'step-100', 'sub/dir')
  assert hub.parse('hf://datasets/org/wiki@refs/convert/parquet/en/train/*.parquet', 'f') == (
      hub.HubName('dataset', 'org/wiki', 'refs/convert/parquet', 'en/train/*.parquet'))
  assert hub.parse('hf://datasets/org/wiki@refs%2Fpr%2F3/a.parquet', 'f').revision == 'refs/pr/3'
  assert str(hub.parse('hf://org/bert@v1/x', 'f')) == 'hf://org/bert@v1/x'
  with pytest.raises(UserError, match=r'--checkpoint=hf://bert-base-uncased: expected '
                                      r'hf://ORG/NAME\[@REVISION\]'):
    hub.parse('hf://bert-base-uncased', '--checkpoint')


def test_pulled_model_is_the_local_folder(online):
  config, params = pretrained.load_pretrained(f'hf://{NAME}')
  local_config, local_params = pretrained.load_pretrained(online['main'])
  assert config == local_config
  _assert_same_params(params, local_params)
  for a, b in zip(_outputs(config, params), _outputs(local_config, local_params)):
    np.testing.assert_array_equal(a, b)
  # Through the Hub's download endpoints into its cache, and only what a checkpoint needs.
  requests = online['hub'].requests
  assert ('GET', f'/api/models/{NAME}/revision/main') in requests
  assert any(r[1].startswith(f'/{NAME}/resolve/') for r in requests)
  folder = hub.checkpoint_folder(f'hf://{NAME}', 'x')
  assert folder.startswith(str(online['home'] / 'hub' / 'models--bert-jax-test--tiny-bert'))
  assert sorted(os.listdir(folder)) == ['config.json', 'model.safetensors',
                                        'tokenizer_config.json', 'vocab.txt']
  # Everything else that reads a checkpoint takes the name too.
  assert pretrained.read_metadata(f'hf://{NAME}')['lower_case'] is True
  assert pretrained.find_vocab(f'hf://{NAME}') == os.path.join(folder, 'vocab.txt')


def test_revisions_and_folders(online):
  _, v1 = pretrained.load_pretrained(f'hf://{NAME}@v1')
  _assert_same_params(v1, pretrained.load_pretrained(online['v1'])[1])
  sha = online['hub'].repos[('model', NAME)].tags['v1']
  _assert_same_params(v1, pretrained.load_pretrained(f'hf://{NAME}@{sha}')[1])
  _, in_folder = pretrained.load_pretrained('hf://bert-jax-test/models/tiny')
  _assert_same_params(in_folder, pretrained.load_pretrained(online['main'])[1])


def test_convert_reads_a_hub_name(online, tmp_path):
  convert.convert(f'hf://{NAME}@v1', str(tmp_path / 'out'), 'bert_jax')
  _assert_same_params(pretrained.load_pretrained(str(tmp_path / 'out'))[1],
                      pretrained.load_pretrained(online['v1'])[1])


def test_a_private_repository_needs_the_token(online, monkeypatch):
  with pytest.raises(UserError, match=(
      r'^--checkpoint=hf://bert-jax-test/private-bert: no model repository '
      r'bert-jax-test/private-bert on the Hub that this machine may read: it does not exist, or '
      r'it is private or gated and no token with access is set')):
    hub.checkpoint_folder('hf://bert-jax-test/private-bert', '--checkpoint')
  monkeypatch.setenv('HF_TOKEN', hub_server.TOKEN)
  assert os.path.isfile(os.path.join(
      hub.checkpoint_folder('hf://bert-jax-test/private-bert', '--checkpoint'),
      'model.safetensors'))


@pytest.mark.parametrize('name, message', [
    ('hf://bert-jax-test/nope', r'no model repository bert-jax-test/nope on the Hub'),
    (f'hf://{NAME}@v9', r'the model repository bert-jax-test/tiny-bert has no revision \'v9\''),
    ('hf://bert-jax-test/gpt', r'not a BERT checkpoint: its config\.json says model_type '
                               r"'gpt2'"),
    ('hf://bert-jax-test/notes', r'not a BERT checkpoint: no config\.json, bert_config\.json or '
                                 r'bert_jax\.json in it \(it has none of its files\)'),
    ('hf://datasets/bert-jax-test/notes/*.parquet', r'a dataset repository, not a model'),
], ids=['missing', 'revision', 'gpt2', 'no_model', 'dataset'])
def test_errors_are_one_line(online, name, message):
  with pytest.raises(UserError, match=message) as e:
    hub.checkpoint_folder(name, 'train.init_checkpoint')
  assert '\n' not in str(e.value) and str(e.value).startswith(f'train.init_checkpoint={name}')


def test_no_network_and_nothing_cached(server, monkeypatch):
  _use(monkeypatch, server, endpoint='http://127.0.0.1:9')  # Nothing listens on port 9.
  with pytest.raises(UserError, match=(
      r'^--checkpoint=hf://bert-jax-test/other: the Hub cannot be reached '
      r'\(http://127\.0\.0\.1:9\) and bert-jax-test/other is not in the Hugging Face cache')):
    hub.checkpoint_folder('hf://bert-jax-test/other', '--checkpoint')
  _use(monkeypatch, server, offline=True)
  with pytest.raises(UserError, match=(
      r'^--checkpoint=hf://bert-jax-test/other@v2: HF_HUB_OFFLINE is set and '
      r'bert-jax-test/other@v2 is not in the Hugging Face cache')):
    hub.checkpoint_folder('hf://bert-jax-test/other@v2', '--checkpoint')


def test_offline_command_reads_the_cache(online, tmp_path):
  """`bert-jax features --init_checkpoint=hf://...` with HF_HUB_OFFLINE=1 and no Hub at all:
  from the cache the earlier pulls filled, the same features as the local folder gives."""
  hub.checkpoint_folder(f'hf://{NAME}', 'x')  # Fills the cache (once per module anyway).
  text = tmp_path / 'input.txt'
  text.write_text('the movie was good .\nan awful plot ||| the story was bad\n')
  local = tmp_path / 'local.npz'
  features.extract_features(online['main'], str(text), str(local), max_seq_length=16)
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu', HF_HUB_OFFLINE='1',
             HF_HOME=str(online['home']), HF_ENDPOINT='http://127.0.0.1:9')
  env.pop('HF_HUB_CACHE', None)
  proc = subprocess.run(
      [sys.executable, '-m', 'bert_jax.cli', 'features', f'--init_checkpoint=hf://{NAME}',
       f'--input={text}', f'--output={tmp_path / "pulled.npz"}', '--max_seq_length=16'],
      env=env, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  pulled, expected = np.load(tmp_path / 'pulled.npz'), np.load(local)
  assert sorted(pulled) == sorted(expected)
  for key in expected:
    np.testing.assert_array_equal(pulled[key], expected[key], err_msg=key)


def test_missing_extra_is_one_line(monkeypatch):
  monkeypatch.setitem(sys.modules, 'huggingface_hub', None)  # As if not installed.
  with pytest.raises(UserError, match=r'^hf:// names and pushes to the Hub need huggingface_hub, '
                                      r'which is not installed: pip install "bert_jax\[hub\]"$'):
    hub.checkpoint_folder('hf://org/bert', '--checkpoint')
