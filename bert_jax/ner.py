"""Named-entity recognition on CoNLL-2003-style files: read, tag schemes, windows, reassembly.

Each word's label sits on its first WordPiece; later pieces, [CLS]/[SEP] and padding get -1
(ignored by the loss and by evaluation). A sentence longer than one window is split at word
boundaries into several windows, and `reassemble` puts the per-window predictions back
together so every word of every sentence gets exactly one predicted tag.
"""

import dataclasses
import os
from typing import Any, Sequence

from absl import logging
import ml_collections
import numpy as np

from bert_jax import batching
from bert_jax import fileio
from bert_jax import metrics
from bert_jax import model as model_lib
from bert_jax import tasks
from bert_jax.errors import UserError

# The CoNLL-2003 tag set (IOB1 and IOB2 use the same tags, only their placement differs).
CONLL_LABELS = ('O', 'B-PER', 'I-PER', 'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC', 'B-MISC', 'I-MISC')
_PREFIXES = ('B-', 'I-', 'E-', 'S-')


@dataclasses.dataclass(frozen=True)
class Sentence:
  words: list[str]
  tags: list[str] | None  # None for unlabelled text.
  line: int  # 1-based line of the first word in its file (for error messages).


def _is_tag(tag: str) -> bool:
  return tag == 'O' or (tag[:2] in _PREFIXES and len(tag) > 2)


def _check_tag(tag: str, where: str) -> None:
  if not _is_tag(tag):
    raise UserError(f'{where}: tag {tag!r} is neither O nor B-/I-/E-/S-<TYPE>')


def _lines(path: str) -> list[str]:
  """The file's lines with universal newlines, as open() reads text (str.splitlines would also
  split on U+0085)."""
  return fileio.read_user_text(path).replace('\r\n', '\n').replace('\r', '\n').split('\n')


def read_conll(path: str, has_tags: bool = True, to_iob2: bool = False) -> list[Sentence]:
  """Sentences of a CoNLL file: one word per line (word first, NER tag last), blank lines
  between sentences, `-DOCSTART-` lines between documents.

  Args:
    path: the file (e.g. CoNLL-2003 eng.train: columns word POS chunk NER, IOB1 tags).
    has_tags: False for text with only a word column.
    to_iob2: convert IOB1 tags to IOB2 (every chunk starts with B-).
  """
  return _conll_sentences(_lines(path), path, has_tags, to_iob2)


def _conll_sentences(lines: list[str], path: str, has_tags: bool, to_iob2: bool
                     ) -> list[Sentence]:
  sentences, words, tags = [], [], []
  first_line = columns = None

  def flush():
    nonlocal words, tags, first_line
    if words:
      sentences.append(Sentence(words, tags if has_tags else None, first_line))
    words, tags, first_line = [], [], None

  for number, line in enumerate(lines, 1):
    fields = line.split()
    if not fields or fields[0] == '-DOCSTART-':
      flush()
      continue
    if columns is None:
      columns = len(fields)
      if has_tags and columns < 2:
        raise UserError(f'{path}:{number}: expected a word and a tag column, got {fields}')
    elif len(fields) != columns:
      raise UserError(f'{path}:{number}: {len(fields)} columns where earlier lines have '
                      f'{columns}')
    if first_line is None:
      first_line = number
    words.append(fields[0])
    if has_tags:
      _check_tag(fields[-1], f'{path}:{number}')
      tags.append(fields[-1])
  flush()
  if not sentences:
    raise UserError(f'{path}: no sentences')
  if to_iob2 and has_tags:
    sentences = [dataclasses.replace(s, tags=iob1_to_iob2(s.tags)) for s in sentences]
  logging.info('%s: %d sentences, %d words', path, len(sentences),
               sum(len(s.words) for s in sentences))
  return sentences


def iob1_to_iob2(tags: Sequence[str]) -> list[str]:
  """I-X that opens a chunk (first tag, after O or after another type) becomes B-X."""
  out = []
  for i, tag in enumerate(tags):
    if tag.startswith('I-'):
      prev = tags[i - 1] if i else 'O'
      if prev == 'O' or prev[2:] != tag[2:]:
        tag = 'B-' + tag[2:]
    out.append(tag)
  return out


def label_list_from_data(sentences: Sequence[Sentence]) -> list[str]:
  """'O' then the data's tags sorted by type, B- before I- (a stable id order)."""
  tags = {t for s in sentences for t in (s.tags or ())} - {'O'}
  order = {p: i for i, p in enumerate(_PREFIXES)}
  return ['O'] + sorted(tags, key=lambda t: (t[2:], order[t[:2]]))


def convert_sentences(sentences: Sequence[Sentence], tok, max_seq_length: int,
                      label_list: Sequence[str]) -> dict[str, np.ndarray]:
  """Windows '[CLS] words [SEP]' with labels on first pieces.

  Returns int32 arrays input_ids, input_mask, segment_ids, labels (-1 = ignore) and
  word_index (word position in its sentence on first pieces, -1 elsewhere) [N, L], and
  sentence_index, feature_index [N].
  """
  if not sentences:
    raise ValueError('convert_sentences: no sentences')
  room = max_seq_length - 2
  if room < 1:
    raise UserError(f'max_seq_length={max_seq_length} leaves no room for words')
  label_map = {l: i for i, l in enumerate(label_list)}
  flat = batching.encode_in_chunks(tok, [w for s in sentences for w in s.words])
  num_empty = num_long = 0
  windows = []  # (sentence index, first word, pieces of each word in the window)
  position = 0
  for si, sentence in enumerate(sentences):
    pieces = flat[position:position + len(sentence.words)]
    position += len(sentence.words)
    if sentence.tags is not None:
      if len(sentence.tags) != len(sentence.words):
        raise UserError(f'sentence at line {sentence.line}: {len(sentence.words)} words but '
                        f'{len(sentence.tags)} tags')
      unknown = sorted(set(sentence.tags) - set(label_map))
      if unknown:
        raise UserError(f'sentence at line {sentence.line}: tags {unknown} not in the label '
                        f'list {list(label_list)}')
    start, current, used = 0, [], 0
    for wi, word_pieces in enumerate(pieces):
      if not word_pieces:  # E.g. a word of control characters: it still needs a prediction.
        word_pieces, num_empty = [tok.unk_id], num_empty + 1
      if len(word_pieces) > room:
        word_pieces, num_long = word_pieces[:room], num_long + 1
      if used + len(word_pieces) > room:
        windows.append((si, start, current))
        start, current, used = wi, [], 0
      current.append(word_pieces)
      used += len(word_pieces)
    windows.append((si, start, current))
  if num_empty:
    logging.warning('NER features: %d words had no WordPiece; they are fed as [UNK]', num_empty)
  if num_long:
    logging.warning('NER features: %d words longer than %d pieces were cut (their label stays '
                    'on the first piece)', num_long, room)
  split = {w[0] for w in windows if w[1] > 0}  # Sentences that needed a second window.
  if split:
    logging.info('NER features: %d sentences longer than %d tokens were split; %d windows for '
                 '%d sentences', len(split), max_seq_length, len(windows), len(sentences))

  n = len(windows)
  input_ids = np.full((n, max_seq_length), tok.pad_id, np.int32)
  input_mask = np.zeros((n, max_seq_length), np.int32)
  labels = np.full((n, max_seq_length), -1, np.int32)
  word_index = np.full((n, max_seq_length), -1, np.int32)
  for row, (si, start, window) in enumerate(windows):
    tags = sentences[si].tags
    ids = [tok.cls_id]
    for offset, word_pieces in enumerate(window):
      word_index[row, len(ids)] = start + offset
      if tags is not None:
        labels[row, len(ids)] = label_map[tags[start + offset]]
      ids.extend(word_pieces)
    ids.append(tok.sep_id)
    input_ids[row, :len(ids)] = ids
    input_mask[row, :len(ids)] = 1
  return {'input_ids': input_ids, 'input_mask': input_mask,
          'segment_ids': np.zeros_like(input_ids), 'labels': labels, 'word_index': word_index,
          'sentence_index': np.array([w[0] for w in windows], np.int32),
          'feature_index': np.arange(n, dtype=np.int32)}


def reassemble(sentences: Sequence[Sentence], features: dict[str, Any], predictions,
               label_list: Sequence[str]) -> list[list[str]]:
  """Per-word tag strings for every sentence from per-window predictions.

  `predictions`: label ids [N, L'] or logits [N, L', C] (or N such rows) in feature order;
  rows may be shorter than L (bucketed batches) but must cover every labelled position.
  """
  word_index, sentence_index = features['word_index'], features['sentence_index']
  if len(predictions) != len(word_index):
    raise ValueError(f'{len(word_index)} features but {len(predictions)} prediction rows')
  out = [[None] * len(s.words) for s in sentences]
  for row, pred in enumerate(predictions):
    pred = np.asarray(pred)
    ids = pred.argmax(-1) if pred.ndim == 2 else pred
    positions = np.flatnonzero(word_index[row] >= 0)
    if len(positions) and positions[-1] >= len(ids):
      raise ValueError(f'prediction row {row} has {len(ids)} positions; word pieces go up to '
                       f'{positions[-1]}')
    tags = out[sentence_index[row]]
    for p in positions:
      tags[word_index[row, p]] = label_list[int(ids[p])]
  for s, tags in zip(sentences, out):
    if None in tags:
      raise ValueError(f'sentence at line {s.line}: {tags.count(None)} words got no prediction '
                       '(features and sentences do not match)')
  return out


# ---------------------------------------------------------------------------------------------
# The fine-tuning task
# ---------------------------------------------------------------------------------------------


def _conll_file(data_dir: str, names: Sequence[str], what: str, required: bool = True):
  for n in names:
    path = os.path.join(data_dir, n)
    if fileio.isfile(path):
      return path
  if required:
    raise UserError(f'config.task.data_dir={data_dir}: no {what} file ({" or ".join(names)})')
  return None


def write_conll(path: str, sentences: Sequence[Sentence],
                predicted: Sequence[Sequence[str]]) -> None:
  """'word gold predicted' per line (conlleval's input; 'word predicted' for sentences without
  tags), a blank line after each sentence."""
  lines = []
  for sentence, tags in zip(sentences, predicted):
    if sentence.tags is None:
      lines.extend(f'{w} {p}\n' for w, p in zip(sentence.words, tags))
    else:
      lines.extend(f'{w} {g} {p}\n' for w, g, p in zip(sentence.words, sentence.tags, tags))
    lines.append('\n')
  fileio.write_text(path, ''.join(lines))


def sniff_format(lines: Sequence[str]) -> str:
  """'conll' or 'text' for the lines of a file to tag: CoNLL has -DOCSTART- lines, or a tag last
  on (nearly) every line, or a word per line in blocks between blank lines; anything else is
  text, a sentence per line. (One word per line with no blank line reads as text.)"""
  fields = [line.split() for line in lines if line.strip()]
  if not fields:
    return 'text'
  if any(f[0] == '-DOCSTART-' for f in fields):
    return 'conll'
  # 90%: one malformed line must still read as CoNLL, so that its error names the line.
  if sum(len(f) > 1 and _is_tag(f[-1]) for f in fields) >= 0.9 * len(fields):
    return 'conll'
  if all(len(f) == 1 for f in fields):
    filled = [bool(line.strip()) for line in lines]
    first, last = filled.index(True), len(filled) - 1 - filled[::-1].index(True)
    return 'text' if all(filled[first:last + 1]) else 'conll'
  return 'text'


def read_sentences(path: str, input_format: str = 'auto') -> tuple[list[Sentence], str]:
  """Sentences to tag, and the format read: 'conll' (a word per line, first column; tags read
  when lines have more columns), 'text' (a sentence per non-blank line, split into words as
  BERT's basic tokenizer splits them: whitespace, and each punctuation mark and CJK character
  apart, so `U.S.` is 4 words; case kept), or 'auto' (`sniff_format`)."""
  lines = _lines(path)
  if input_format == 'auto':
    input_format = sniff_format(lines)
    logging.info('%s: read as %s', path, input_format)
  if input_format == 'conll':
    has_tags = any(len(line.split()) > 1 and not line.startswith('-DOCSTART-')
                   for line in lines)
    return _conll_sentences(lines, path, has_tags, to_iob2=False), input_format
  if input_format != 'text':
    raise ValueError(f'input_format={input_format!r}: expected auto, conll or text')
  from bert_jax import squad  # pylint: disable=g-import-not-at-top  (TensorFlow)
  sentences = []
  for number, line in enumerate(lines, 1):
    words = squad.basic_tokenize(line, lower_case=False)
    if words:
      sentences.append(Sentence(words, None, number))
  if not sentences:
    raise UserError(f'{path}: no sentences')
  return sentences, input_format


def tags_and_scores(sentences: Sequence[Sentence], features: dict[str, Any], rows,
                    label_list: Sequence[str]) -> tuple[list[list[str]], dict | None]:
  """Every word's predicted tag from the windows' predictions `rows` (see `reassemble`), and
  entity-level scores when every sentence has gold tags (else None)."""
  predicted = reassemble(sentences, features, rows, label_list)
  if any(s.tags is None for s in sentences):
    return predicted, None
  return predicted, metrics.ner_metrics([s.tags for s in sentences], predicted)


def accepts(task: str) -> bool:
  """Whether config.task.name names this task."""
  return task.lower().replace('-', '_').replace('.', '') in ('ner', 'conll2003')


def check_tags(sentences: Sequence[Sentence], path: str, label_list: Sequence[str],
               origin: str) -> None:
  """Raises a UserError at the first tag of the file `path` that is not in `label_list`, naming
  the file, its line and where the list came from (`origin`) and how to fix it."""
  known = set(label_list)
  for sentence in sentences:
    for offset, tag in enumerate(sentence.tags or ()):
      if tag not in known:
        raise UserError(f'{path}:{sentence.line + offset}: tag {tag!r} is not in {origin} '
                        f'({", ".join(label_list)}): fix the tag, or set --config.task.label_list '
                        'to every tag of the data')


def make_task(config: ml_collections.ConfigDict, tok, bert_config: model_lib.BertConfig,
              lower_case: bool) -> tasks.Task:
  """The NER task of `config` (finetune_ner.py's keys): CoNLL files, token head, span F1."""
  del lower_case  # Words are tagged as the tokenizer splits them, cased or not.
  if not config.task.data_dir:
    raise UserError('config.task.data_dir is empty: the folder of train.txt, valid.txt, test.txt')
  fileio.check_input_dir(config.task.data_dir, 'config.task.data_dir')
  train_path = _conll_file(config.task.data_dir, ['train.txt'], 'training')
  train_sentences = read_conll(train_path)
  label_list = list(config.task.label_list)
  origin = 'config.task.label_list'
  if not label_list:
    tags = {t for s in train_sentences for t in s.tags}
    label_list = (list(CONLL_LABELS) if tags <= set(CONLL_LABELS)
                  else label_list_from_data(train_sentences))
    origin = f'the tags of {train_path}, the label list while config.task.label_list is empty'
  check_tags(train_sentences, train_path, label_list, origin)
  logging.info('NER labels: %s', label_list)

  def eval_set(name, path):
    sentences = read_conll(path)
    check_tags(sentences, path, label_list, origin)
    feats = convert_sentences(sentences, tok, config.data.max_seq_length, label_list)

    def evaluate(rows):
      predicted, scores = tags_and_scores(sentences, feats, rows, label_list)
      return scores, lambda d: write_conll(os.path.join(d, f'{name}.conll'), sentences,
                                            predicted)
    return tasks.EvalSet(name, tasks.subset(feats, tasks.INPUTS, 'feature_index'), evaluate)

  dev = [eval_set('dev', _conll_file(config.task.data_dir, ['valid.txt', 'dev.txt'], 'dev'))]
  test = []
  if config.eval.predict_test:
    test = [eval_set('test', _conll_file(config.task.data_dir, ['test.txt'], 'test'))]
  train = convert_sentences(train_sentences, tok, config.data.max_seq_length, label_list)
  return tasks.Task(
      kind='ner', head='token',
      model=model_lib.BertForTokenClassification(bert_config, num_labels=len(label_list)),
      loss_fn=tasks.token_loss, label_keys=('labels',),
      train=tasks.subset(train, tasks.INPUTS + ('labels',)), dev=dev, test=test,
      main_metric='f1', metric_names=('precision', 'recall', 'f1', 'accuracy'),
      info={'task': 'ner', 'labels': label_list})


def prediction(input_path: str, input_format: str, tok, bert_config: model_lib.BertConfig,
               info: dict, run: ml_collections.ConfigDict, lower_case: bool) -> tasks.Prediction:
  """`bert-jax predict` on CoNLL or text (`read_sentences`): CoNLL lines 'word [gold]
  predicted' out, entity-level scores for tagged input."""
  del run, lower_case
  sentences, input_format = read_sentences(input_path, input_format)
  labels = info['labels']
  features = convert_sentences(sentences, tok, int(info['max_seq_length']), labels)

  def finish(rows, output_path):
    predicted, scores = tags_and_scores(sentences, features, rows, labels)
    write_conll(output_path, sentences, predicted)
    return scores, {}
  return tasks.Prediction(
      input_format, len(sentences),
      model_lib.BertForTokenClassification(bert_config, num_labels=len(labels)), 'token',
      tasks.subset(features, tasks.INPUTS, 'feature_index'), finish)
