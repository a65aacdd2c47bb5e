"""A workdir's run files through tf.io.gfile: a non-local filesystem (TensorFlow's ram://) stands
in for Cloud Storage, which the machines that run these tests cannot reach."""

import json
import os

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
