"""A pre-training workdir as `bert-jax pretrain` leaves it, made in a second for the tests."""

import json
import os

import jax
import numpy as np


def training_workdir(workdir: str, config, params: dict, vocab_file: str, step: int = 1,
                     lower_case: bool = True) -> str:
  """`workdir` with config.json, bert_config.json, vocab.txt and checkpoint `step` holding
  `params` (a BertForPreTraining's) and an optimizer state of zeros."""
  from bert_jax import checkpoint  # pylint: disable=g-import-not-at-top
  from bert_jax import run_files  # pylint: disable=g-import-not-at-top
  from bert_jax import train_state  # pylint: disable=g-import-not-at-top
  run = {'kind': 'pretrain', 'data': {'lower_case': lower_case, 'max_seq_length': 128}}
  run_files.write_run_files(workdir, json.dumps(run), config, vocab_file)
  manager = checkpoint.make_manager(workdir, keep=None, async_save=False,
                                    replica_parallel=False)
  state = train_state.TrainState(step=np.int32(step), params=params,
                                 opt_state=jax.tree.map(np.zeros_like, params))
  checkpoint.save(manager, workdir, step, state, {'seed': 0})
  manager.close()
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(step)))
  return workdir
