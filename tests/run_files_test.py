"""A workdir's run files through tf.io.gfile (a non-local filesystem, TensorFlow's ram://, stands
in for Cloud Storage, which the machines that run these tests cannot reach), and a training
workdir loaded as a checkpoint."""

import json
import os

import pytest

from bert_jax import fileio
from bert_jax import model as model_lib
from bert_jax import run_files


def test_run_files_on_a_non_local_filesystem(tmp_path):
  vocab = tmp_path / 'vocab.txt'
  vocab.write_text('[PAD]\n[UNK]\n')
  workdir = 'ram://bert_jax_test/files'
  config = model_lib.BertConfig(vocab_size=2, hidden_size=8, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=16)
  run_files.write_run_files(workdir, '{"a": 1}', config, str(vocab))
  fs = fileio.gfile()
  assert json.loads(fs.GFile(os.path.join(workdir, 'config.json')).read()) == {'a': 1}
  written = json.loads(fs.GFile(os.path.join(workdir, 'bert_config.json')).read())
  assert written == config.to_original_dict()
  assert fs.GFile(os.path.join(workdir, 'vocab.txt')).read() == '[PAD]\n[UNK]\n'


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
  """A tiny pre-training workdir (`workdirs.training_workdir`) and its parameters."""
  import jax  # pylint: disable=g-import-not-at-top
  import workdirs  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('pretrained')
  vocab = root / 'vocab.txt'
  vocab.write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'the', 'a']) + '\n')
  config = model_lib.BertConfig(vocab_size=7, hidden_size=16, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=32,
                                max_position_embeddings=32)
  params = model_lib.init_params(config, jax.random.key(0))
  return workdirs.training_workdir(str(root / 'w' / 'base'), config, params, str(vocab)), params


def test_a_workdir_named_by_a_relative_path_loads(pretrained, monkeypatch):
  """Orbax takes absolute paths only: `--checkpoint=w/base` (any command that loads a
  workdir: convert, features, fill-mask, predict, train.init_checkpoint) is made absolute."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from bert_jax import pretrained as pretrained_lib  # pylint: disable=g-import-not-at-top
  workdir, params = pretrained
  monkeypatch.chdir(os.path.dirname(os.path.dirname(workdir)))
  config, loaded = run_files.load_pretrained_from_workdir('w/base')
  assert config.num_hidden_layers == 2
  np.testing.assert_array_equal(
      loaded['bert']['embeddings']['word_embeddings']['embedding'],
      params['bert']['embeddings']['word_embeddings']['embedding'])
  monkeypatch.chdir(os.path.dirname(workdir))
  _, _, tok, vocab, lower_case = pretrained_lib.load_checkpoint('./base', flag='--checkpoint')
  assert (tok.vocab_size, vocab, lower_case) == (7, './base/vocab.txt', True)


def test_only_a_checkpoint_with_files_missing_is_called_damaged(pretrained, tmp_path,
                                                                monkeypatch):
  """The advice to move a step folder aside is for a step whose files are missing or cut
  short; any other failure keeps its own error (never the advice to set a good one aside)."""
  import shutil  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from bert_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / 'copy')
  shutil.copytree(pretrained[0], workdir)
  step = os.path.join(workdir, 'checkpoints', '1')
  with monkeypatch.context() as patch:
    patch.setattr(ocp.StandardCheckpointHandler, 'restore',
                  lambda *a, **k: (_ for _ in ()).throw(RuntimeError('a bug')))
    with pytest.raises(RuntimeError, match='^a bug$'):
      run_files.load_pretrained_from_workdir(workdir)
  os.remove(os.path.join(step, 'params', '_METADATA'))
  with pytest.raises(UserError, match=rf'^{step}: damaged or incomplete checkpoint \(.*_METADATA'
                     r'.* does not exist.*\); move that folder aside to use an earlier step'):
    run_files.load_pretrained_from_workdir(workdir)
  shutil.rmtree(os.path.join(step, 'params'))
  with pytest.raises(UserError, match=r'damaged or incomplete checkpoint \(it holds no params\)'):
    run_files.load_pretrained_from_workdir(workdir)


def test_a_workdir_loads_without_orbax_warnings_and_names_a_missing_step(pretrained, caplog):
  """Only the params item is read, by its own handler: no warning of the step's other items
  (optimizer state, meta; FP8 scales), which a manager over the whole step printed twice each
  in every command and notebook that loaded a workdir. A step the workdir does not hold is
  named with the ones it does (not called damaged)."""
  from bert_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  workdir, _ = pretrained
  with caplog.at_level('WARNING'):
    config, params = run_files.load_pretrained_from_workdir(workdir)
    assert run_files.load_pretrained_from_workdir(workdir, step=1)[0] == config
  assert not [r.getMessage() for r in caplog.records if r.levelname != 'INFO'], caplog.text
  assert sorted(params) == ['bert', 'mlm', 'nsp']
  with pytest.raises(UserError, match=r'/checkpoints holds no complete checkpoint of step 3 '
                                      r'\(its steps: 1\)$'):
    run_files.load_pretrained_from_workdir(workdir, step=3)
