"""Writes pre-training TFRecords in create_pretraining_data.py's format, for the tests."""

from typing import Iterable

import numpy as np


def write_pretraining_records(path: str, examples: Iterable[dict[str, np.ndarray]]) -> None:
  """One tf.train.Example per dict: masked_lm_weights as floats, every other key as int64s."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.io.TFRecordWriter(path) as writer:
    for example in examples:
      feature = {k: (tf.train.Feature(float_list=tf.train.FloatList(value=v))
                     if k == 'masked_lm_weights' else
                     tf.train.Feature(int64_list=tf.train.Int64List(value=v)))
                 for k, v in example.items()}
      writer.write(tf.train.Example(features=tf.train.Features(feature=feature))
                   .SerializeToString())
