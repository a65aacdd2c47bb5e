"""SQuAD v1.1 / v2.0: read the official JSON, cut sliding windows, decode answer spans.

Semantics follow the original run_squad.py: the context is split on whitespace into words
(answers are word spans), each word is WordPiece-tokenized, a long document is covered by
windows `doc_stride` tokens apart, each token is scored only in the window where it has the
most context, and a predicted span is mapped back onto the original text by aligning the
tokenizer's normalised text with the original characters.
"""

import collections
import dataclasses
import functools
import json
import math
import os
import unicodedata
from typing import Any, Mapping, Sequence

from absl import logging
import ml_collections
import numpy as np

from bert_jax import batching
from bert_jax import errors
from bert_jax import fileio
from bert_jax import metrics
from bert_jax import model as model_lib
from bert_jax import tasks
from bert_jax import tokenization
from bert_jax.errors import UserError


@dataclasses.dataclass
class SquadExample:
  """One question; positions are word indices into `doc_tokens` (None when not training)."""
  qas_id: str
  question_text: str
  doc_tokens: list[str]
  answers: list[str]  # Every gold answer text (empty for impossible questions).
  plausible_answers: list[str] = dataclasses.field(default_factory=list)  # v2.0, unused.
  orig_answer_text: str | None = None
  start_position: int | None = None
  end_position: int | None = None
  is_impossible: bool = False


def _is_whitespace(c: str) -> bool:
  return c in ' \t\r\n' or ord(c) == 0x202F


def split_context(text: str) -> tuple[list[str], list[int]]:
  """Whitespace words of `text` and, for each character, the index of its word."""
  words, char_to_word = [], []
  after_space = True
  for c in text:
    if _is_whitespace(c):
      after_space = True
    else:
      if after_space:
        words.append(c)
      else:
        words[-1] += c
      after_space = False
    char_to_word.append(len(words) - 1)
  return words, char_to_word


def read_squad(source: str | Mapping, is_training: bool) -> list[SquadExample]:
  """Examples from a SQuAD JSON file (or its parsed dict); v2.0's `is_impossible` is honoured.

  For training, the answer (the first one) becomes a word span; questions whose answer text is
  not found at its `answer_start` are skipped and counted, as the original does. Invalid JSON is
  reported with its line and column, a missing or mistyped field with its place in the file
  (`data[0].paragraphs[2].qas[1]`).
  """
  name = source if isinstance(source, str) else '<SQuAD dict>'
  if isinstance(source, str):
    try:
      source = json.loads(fileio.read_user_text(source))
    except json.JSONDecodeError as e:
      raise UserError(f'{name}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}') from None
  if not isinstance(source, Mapping) or 'data' not in source:
    raise UserError(f'{name}: no "data" key; not a SQuAD file')
  examples, skipped = [], []
  where = 'data'
  try:
    for a, article in enumerate(source['data']):
      for p, paragraph in enumerate(article['paragraphs']):
        where = f'data[{a}].paragraphs[{p}]'
        context = paragraph['context']
        doc_tokens, char_to_word = split_context(context)
        for q, qa in enumerate(paragraph['qas']):
          where = f'data[{a}].paragraphs[{p}].qas[{q}]'
          example = _read_question(qa, context, doc_tokens, char_to_word, is_training)
          if example is None:
            skipped.append(f'{qa["id"]} ({where})')
          else:
            examples.append(example)
  except KeyError as e:
    raise UserError(f'{name}: {where}: missing key {e}') from None
  except (TypeError, AttributeError, ValueError) as e:
    raise UserError(f'{name}: {where}: {e}') from None
  errors.check_skipped(name, skipped, len(skipped) + len(examples),
                       'questions have no answer at their answer_start',
                       'answer_start counts characters of the context from 0 (check the '
                       "file's offsets: bytes or a stripped context shift them)")
  if skipped:
    logging.warning('%s: skipped %d questions whose answer is not found in the context, e.g. '
                    '%s', name, len(skipped), skipped[:5])
  if not examples:
    raise UserError(f'{name}: no usable questions')
  logging.info('%s: %d questions', name, len(examples))
  return examples


def _read_question(qa: Mapping, context: str, doc_tokens: list[str], char_to_word: list[int],
                   is_training: bool) -> SquadExample | None:
  """One question; None when its training answer is not found in the context."""
  qid = qa['id']
  impossible = bool(qa.get('is_impossible', False))
  answers = [a['text'] for a in qa.get('answers', [])]
  example = SquadExample(
      qid, qa['question'], doc_tokens, answers,
      [a['text'] for a in qa.get('plausible_answers', [])], is_impossible=impossible)
  if is_training and impossible:
    example.orig_answer_text, example.start_position, example.end_position = '', -1, -1
  elif is_training:
    if not answers:
      raise UserError(f'question {qid} has no answer and is not marked is_impossible')
    answer = qa['answers'][0]
    text, start = answer['text'], int(answer['answer_start'])
    end = start + len(text) - 1
    if not text or start < 0 or end >= len(context):
      return None
    first, last = char_to_word[start], char_to_word[end]
    # The answer must read the same (up to whitespace) in the words it maps to.
    if ' '.join(text.split()) not in ' '.join(doc_tokens[first:last + 1]):
      return None
    example.orig_answer_text, example.start_position, example.end_position = (
        text, first, last)
  return example


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


def _doc_spans(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
  """(start, length) windows over the document; the last one ends at the document end."""
  spans, start = [], 0
  while True:
    length = min(num_tokens - start, max_tokens)
    spans.append((start, length))
    if start + length >= num_tokens:
      return spans
    start += min(length, stride)


def _max_context_windows(spans: list[tuple[int, int]], num_tokens: int) -> np.ndarray:
  """For each document token, the window where it has the most context.

  A token's score in a window is min(left context, right context) + 0.01 * window length;
  the best (the first on ties) wins. Scoring each token once, in the window where it sits
  most centrally, avoids both counting it twice and scoring it next to a window edge.
  """
  positions = np.arange(num_tokens)
  scores = np.full((len(spans), num_tokens), -np.inf)
  for i, (start, length) in enumerate(spans):
    inside = (positions >= start) & (positions < start + length)
    context = np.minimum(positions - start, start + length - 1 - positions)
    scores[i, inside] = context[inside] + 0.01 * length
  return scores.argmax(0)


def _improve_span(doc_ids: list[int], start: int, end: int, answer_ids: list[int]
                  ) -> tuple[int, int]:
  """The tightest sub-span of [start, end] whose tokens equal the answer's own tokenization
  (e.g. "1895" inside the word "(1895)")."""
  for new_start in range(start, end + 1):
    for new_end in range(end, new_start - 1, -1):
      if doc_ids[new_start:new_end + 1] == answer_ids:
        return new_start, new_end
  return start, end


def convert_examples(examples: Sequence[SquadExample], tok, max_seq_length: int = 384,
                     doc_stride: int = 128, max_query_length: int = 64,
                     is_training: bool = False) -> dict[str, Any]:
  """Windows '[CLS] query [SEP] doc-window [SEP]' of every example.

  Returns numpy arrays input_ids, input_mask, segment_ids [F, L] int32; example_index,
  feature_index, doc_span_index [F]; token_to_orig [F, L] (word index of each document token,
  -1 elsewhere); token_is_max_context [F, L] (0/1); for training start_positions and
  end_positions [F] (0 = [CLS]: answer outside the window, or impossible). For evaluation also
  `tokens`, a list of token-string lists that `decode_predictions` needs.
  """
  if not examples:
    raise ValueError('convert_examples: no SQuAD examples')
  # Every tokenizer call has a fixed cost of milliseconds: tokenize all questions, paragraphs
  # (shared by their questions) and answers in a few large calls.
  queries = batching.encode_in_chunks(tok, [e.question_text for e in examples])
  max_doc_tokens = max_seq_length - min(max_query_length, max(map(len, queries))) - 3
  if max_doc_tokens < 1:
    raise UserError(f'max_seq_length={max_seq_length} leaves no room for the document with '
                    f'max_query_length={max_query_length}')
  if doc_stride < 1:
    raise UserError(f'doc_stride must be positive, got {doc_stride}')
  docs = list({id(e.doc_tokens): e.doc_tokens for e in examples}.items())
  flat = batching.encode_in_chunks(tok, [w for _, words in docs for w in words])
  doc_cache, position = {}, 0
  for key, words in docs:
    pieces = flat[position:position + len(words)]
    position += len(words)
    tok_to_orig = [w for w, p in enumerate(pieces) for _ in p]
    orig_to_tok = np.cumsum([0] + [len(p) for p in pieces]).tolist()
    doc_cache[key] = ([i for p in pieces for i in p], tok_to_orig, orig_to_tok)
  answered = [i for i, e in enumerate(examples) if is_training and not e.is_impossible]
  if answered and examples[answered[0]].start_position is None:
    raise ValueError('training features need answer positions: read the examples with '
                     'read_squad(..., is_training=True)')
  answer_ids = dict(zip(answered, batching.encode_in_chunks(
      tok, [examples[i].orig_answer_text for i in answered])))

  rows = collections.defaultdict(list)
  tokens_out = []
  num_cut_queries = num_empty_docs = 0
  for example_index, example in enumerate(examples):
    query = queries[example_index]
    if len(query) > max_query_length:
      query = query[:max_query_length]
      num_cut_queries += 1
    doc_ids, tok_to_orig, orig_to_tok = doc_cache[id(example.doc_tokens)]
    num_empty_docs += not doc_ids

    tok_start = tok_end = None
    if example_index in answer_ids:
      tok_start = orig_to_tok[example.start_position]
      tok_end = orig_to_tok[example.end_position + 1] - 1
      tok_start, tok_end = _improve_span(doc_ids, tok_start, tok_end, answer_ids[example_index])

    max_tokens = max_seq_length - len(query) - 3
    spans = _doc_spans(len(doc_ids), max_tokens, doc_stride)
    best_window = _max_context_windows(spans, len(doc_ids))
    for span_index, (start, length) in enumerate(spans):
      ids = [tok.cls_id] + query + [tok.sep_id] + doc_ids[start:start + length] + [tok.sep_id]
      offset = len(query) + 2
      orig = np.full(max_seq_length, -1, np.int32)
      orig[offset:offset + length] = tok_to_orig[start:start + length]
      max_context = np.zeros(max_seq_length, np.int32)
      max_context[offset:offset + length] = best_window[start:start + length] == span_index
      padded = np.full(max_seq_length, tok.pad_id, np.int32)
      padded[:len(ids)] = ids
      rows['input_ids'].append(padded)
      rows['input_mask'].append(np.arange(max_seq_length) < len(ids))
      rows['segment_ids'].append((np.arange(max_seq_length) >= offset) &
                                 (np.arange(max_seq_length) < len(ids)))
      rows['example_index'].append(example_index)
      rows['doc_span_index'].append(span_index)
      rows['token_to_orig'].append(orig)
      rows['token_is_max_context'].append(max_context)
      if is_training:
        if example.is_impossible or not (start <= tok_start and tok_end < start + length):
          rows['start_positions'].append(0)
          rows['end_positions'].append(0)
        else:
          rows['start_positions'].append(tok_start - start + offset)
          rows['end_positions'].append(tok_end - start + offset)
      else:
        tokens_out.append(tok.decode(ids))
  if num_cut_queries:
    logging.warning('SQuAD features: truncated %d questions to max_query_length=%d',
                    num_cut_queries, max_query_length)
  if num_empty_docs:
    logging.warning('SQuAD features: %d questions have an empty context', num_empty_docs)
  features = {k: np.asarray(v).astype(np.int32) for k, v in rows.items()}
  features['feature_index'] = np.arange(len(features['input_ids']), dtype=np.int32)
  if not is_training:
    features['tokens'] = tokens_out
  logging.info('SQuAD features: %d windows for %d questions', len(features['input_ids']),
               len(examples))
  return features


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _char_class(c: str) -> str:
  """'drop', 'space', 'cjk', 'punct' or 'other' (cached: decoding classifies many chars)."""
  if tokenization.is_dropped(c):
    return 'drop'
  if tokenization.is_space(c):
    return 'space'
  if tokenization.is_cjk(ord(c)):
    return 'cjk'
  return 'punct' if tokenization.is_punctuation(c) else 'other'


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
  """The original BasicTokenizer (clean-up, CJK, lower-casing and accents, punctuation), with
  the character classes of `tokenization` so it agrees with the WordPiece tokenizer."""
  chars = []
  for c in text:
    kind = _char_class(c)
    if kind == 'space':
      chars.append(' ')
    elif kind == 'cjk':
      chars.append(f' {c} ')
    elif kind != 'drop':
      chars.append(c)
  tokens = []
  for word in ''.join(chars).split():
    if lower_case:
      word = word.lower()
      word = ''.join(c for c in unicodedata.normalize('NFD', word)
                     if unicodedata.category(c) != 'Mn')
    current = ''
    for c in word:
      if _char_class(c) == 'punct':
        tokens.extend([current, c] if current else [c])
        current = ''
      else:
        current += c
    if current:
      tokens.append(current)
  return tokens


def _without_spaces(text: str) -> tuple[str, list[int]]:
  """`text` with spaces removed, and the position in `text` of each kept character."""
  kept = [i for i, c in enumerate(text) if c != ' ']
  return ''.join(text[i] for i in kept), kept


def project_to_original(pred_text: str, orig_text: str, lower_case: bool) -> str:
  """The part of `orig_text` (original words) that the normalised `pred_text` came from.

  The predicted tokens are normalised (lower-cased, accents and punctuation split off), so
  find them in the normalised original, then map character positions back through both
  texts with spaces removed, which line up one-to-one when normalisation kept the character
  count. Falls back to the whole `orig_text` when the alignment fails, as the original does.
  """
  normalised = ' '.join(basic_tokenize(orig_text, lower_case))
  start = normalised.find(pred_text)
  if start < 0:
    return orig_text
  end = start + len(pred_text) - 1
  orig_chars, orig_pos = _without_spaces(orig_text)
  norm_chars, norm_pos = _without_spaces(normalised)
  if len(orig_chars) != len(norm_chars):
    return orig_text
  norm_index = {p: i for i, p in enumerate(norm_pos)}
  if start not in norm_index or end not in norm_index:
    return orig_text
  return orig_text[orig_pos[norm_index[start]]:orig_pos[norm_index[end]] + 1]


def _top_indices(logits: np.ndarray, n: int) -> np.ndarray:
  return np.argsort(-logits, kind='stable')[:n]


def _softmax(scores: list[float]) -> list[float]:
  if not scores:
    return []
  top = max(scores)
  exps = [math.exp(s - top) for s in scores]
  return [e / sum(exps) for e in exps]


def decode_predictions(examples: Sequence[SquadExample], features: Mapping[str, Any],
                       start_logits, end_logits, n_best_size: int = 20,
                       max_answer_length: int = 30, version_2: bool = False,
                       null_score_diff_threshold: float = 0.0, do_lower_case: bool = True
                       ) -> tuple[dict[str, str], dict[str, float], dict[str, list[dict]]]:
  """Best answer text per question from per-window start/end logits.

  Args:
    examples, features: from `read_squad(..., is_training=False)` and `convert_examples`.
    start_logits, end_logits: [F, L'] (or F rows) in feature order, L' <= L (bucketed
      batches may be shorter; positions past a row do not exist).
    version_2: allow '' (no answer): its score is the smallest [CLS] start+end over the
      question's windows; '' is predicted when it beats the best span by more than
      `null_score_diff_threshold`.

  Returns:
    (qid -> text, qid -> null score minus best span score (v2 only), qid -> n-best list).
  """
  if 'tokens' not in features:
    raise ValueError("features lack 'tokens': decode the features of "
                     'convert_examples(..., is_training=False)')
  num_features = len(features['input_ids'])
  if len(start_logits) != num_features or len(end_logits) != num_features:
    raise ValueError(f'{num_features} features but {len(start_logits)} start and '
                     f'{len(end_logits)} end logit rows')
  by_example = collections.defaultdict(list)
  for f, e in enumerate(features['example_index']):
    by_example[int(e)].append(f)
  predictions, null_odds, all_nbest = {}, {}, {}
  for example_index, example in enumerate(examples):
    candidates = []  # (score, feature, start, end, start logit, end logit)
    null = None  # (score, start logit, end logit) of the lowest-scoring [CLS].
    for f in by_example.get(example_index, []):
      starts = np.asarray(start_logits[f], np.float64)
      ends = np.asarray(end_logits[f], np.float64)
      num_tokens = min(len(features['tokens'][f]), len(starts), len(ends))
      to_orig = features['token_to_orig'][f]
      max_context = features['token_is_max_context'][f]
      if version_2 and (null is None or starts[0] + ends[0] < null[0]):
        null = (starts[0] + ends[0], starts[0], ends[0])
      # Ranked among the window's own tokens: padding (as long as the batch's length bucket
      # makes it) never takes an n-best place, so an answer does not depend on the batch it
      # was predicted in (a served model's batches are not `predict`'s).
      for s in _top_indices(starts[:num_tokens], n_best_size):
        if to_orig[s] < 0 or not max_context[s]:
          continue
        for e in _top_indices(ends[:num_tokens], n_best_size):
          if to_orig[e] < 0 or e < s or e - s + 1 > max_answer_length:
            continue
          candidates.append((starts[s] + ends[e], f, int(s), int(e), starts[s], ends[e]))
    if null is not None:
      candidates.append((null[0], None, 0, 0, null[1], null[2]))
    candidates.sort(key=lambda c: c[0], reverse=True)  # Stable: ties keep window order.

    nbest, seen = [], set()
    for _, f, s, e, start_logit, end_logit in candidates:
      if len(nbest) >= n_best_size:
        break
      if f is None:
        text = ''
      else:
        pieces = ' '.join(features['tokens'][f][s:e + 1])
        pred_text = ' '.join(pieces.replace(' ##', '').replace('##', '').split())
        words = example.doc_tokens[features['token_to_orig'][f][s]:
                                   features['token_to_orig'][f][e] + 1]
        text = project_to_original(pred_text, ' '.join(words), do_lower_case)
      if text in seen:
        continue
      seen.add(text)
      nbest.append({'text': text, 'start_logit': float(start_logit),
                    'end_logit': float(end_logit)})
    if null is not None and '' not in seen:
      nbest.append({'text': '', 'start_logit': float(null[1]), 'end_logit': float(null[2])})
    if not nbest:  # No valid span in any window (rare): answer nothing.
      nbest.append({'text': '', 'start_logit': 0.0, 'end_logit': 0.0})
    for entry, p in zip(nbest, _softmax([n['start_logit'] + n['end_logit'] for n in nbest])):
      entry['probability'] = p
    all_nbest[example.qas_id] = nbest
    if not version_2:
      predictions[example.qas_id] = nbest[0]['text']
      continue
    best = next((n for n in nbest if n['text']), None)
    if best is None:  # Only the empty answer survived: certain no-answer.
      null_odds[example.qas_id] = 1e6
      predictions[example.qas_id] = ''
      continue
    diff = null[0] - best['start_logit'] - best['end_logit']
    null_odds[example.qas_id] = float(diff)
    predictions[example.qas_id] = '' if diff > null_score_diff_threshold else best['text']
  return predictions, null_odds, all_nbest


def gold_answers(examples: Sequence[SquadExample]) -> dict[str, list[str]]:
  """qid -> gold texts for `metrics.squad_evaluate` (no-answer questions -> [''])."""
  return {e.qas_id: ([] if e.is_impossible else list(e.answers)) or [''] for e in examples}


def answers_and_scores(examples: Sequence[SquadExample], features: Mapping[str, Any], rows,
                       settings: ml_collections.ConfigDict, version_2: bool, lower_case: bool
                       ) -> tuple[dict | None, dict[str, str], dict[str, float] | None, dict]:
  """Decodes per-window outputs `rows` ([2, L'] start and end logits each) with the
  n_best_size, max_answer_length and null_score_diff_threshold of `settings` (config.task).

  Returns (official scores, or None when some question has neither answers nor is_impossible;
  qid -> answer; qid -> no-answer odds, v2 only; qid -> n-best list).
  """
  answers, null_odds, nbest = decode_predictions(
      examples, features, [r[0] for r in rows], [r[1] for r in rows],
      n_best_size=settings.n_best_size, max_answer_length=settings.max_answer_length,
      version_2=version_2, null_score_diff_threshold=settings.null_score_diff_threshold,
      do_lower_case=lower_case)
  null_odds = null_odds if version_2 else None
  scores = None
  if all(e.answers or e.is_impossible for e in examples):
    scores = metrics.squad_evaluate(gold_answers(examples), answers, null_odds)
  return scores, answers, null_odds, nbest


def write_predictions(output_dir: str, predictions: Mapping[str, str],
                      null_odds: Mapping[str, float] | None = None,
                      nbest: Mapping[str, list] | None = None) -> dict[str, str]:
  """Writes predictions.json (and null_odds.json, nbest_predictions.json); returns paths."""
  paths = {}
  for name, value in (('predictions', predictions), ('null_odds', null_odds),
                      ('nbest_predictions', nbest)):
    if value is not None:
      paths[name] = os.path.join(output_dir, f'{name}.json')
      fileio.write_text(paths[name], json.dumps(value, indent=2, ensure_ascii=False))
  return paths


# ---------------------------------------------------------------------------------------------
# The fine-tuning task
# ---------------------------------------------------------------------------------------------


def _read_squad(path: str, is_training: bool, flag: str) -> list[SquadExample]:
  if not fileio.exists(path):
    raise UserError(f'{flag}: no SQuAD file {path}')  # A folder or unreadable: read_squad says.
  # Errors name the file and the line (invalid JSON) or the question (missing fields).
  return read_squad(path, is_training)


def _version(task: str) -> int | None:
  """1 or 2 for the names of SQuAD v1.1 and v2.0 (squad_v1, squad-v1.1, ...); else None."""
  return {'squad_v1': 1, 'squad_v11': 1, 'squad_v2': 2, 'squad_v20': 2}.get(
      task.lower().replace('-', '_').replace('.', ''))


def accepts(task: str) -> bool:
  """Whether config.task.name names this task."""
  return _version(task) is not None


def make_task(config: ml_collections.ConfigDict, tok, bert_config: model_lib.BertConfig,
              lower_case: bool) -> tasks.Task:
  """The SQuAD task of `config` (finetune_squad.py's keys): windows, span head, decoding."""
  version_2 = _version(config.task.name) == 2
  suffix = 'v2.0' if version_2 else 'v1.1'
  settings = config.task
  train_file = settings.train_file or os.path.join(settings.data_dir, f'train-{suffix}.json')
  predict_file = settings.predict_file or os.path.join(settings.data_dir, f'dev-{suffix}.json')
  convert_args = dict(max_seq_length=config.data.max_seq_length, doc_stride=settings.doc_stride,
                      max_query_length=settings.max_query_length)
  train_examples = _read_squad(train_file, True, 'config.task.train_file')
  train = convert_examples(train_examples, tok, is_training=True, **convert_args)
  dev_examples = _read_squad(predict_file, False, 'config.task.predict_file')
  unanswered = [e.qas_id for e in dev_examples if not (e.answers or e.is_impossible)]
  if unanswered:
    raise UserError(f'config.task.predict_file={predict_file}: {len(unanswered)} questions have '
                    f'no answers and are not is_impossible (e.g. {unanswered[:3]}), but it is the '
                    'dev set scored after each epoch: give the dev file (bert-jax predict '
                    'answers new questions)')
  dev_features = convert_examples(dev_examples, tok, is_training=False, **convert_args)

  def evaluate(rows):
    scores, predictions, null_odds, nbest = answers_and_scores(
        dev_examples, dev_features, rows, config.task, version_2, lower_case)
    return scores, lambda d: write_predictions(d, predictions, null_odds, nbest)

  names = ('exact', 'f1', 'best_exact', 'best_f1') if version_2 else ('exact', 'f1')
  return tasks.Task(
      kind='squad', head='span', model=model_lib.BertForQuestionAnswering(bert_config),
      loss_fn=tasks.span_loss, label_keys=('start_positions', 'end_positions'),
      train=tasks.subset(train, tasks.INPUTS + ('start_positions', 'end_positions')),
      dev=[tasks.EvalSet('dev', tasks.subset(dev_features, tasks.INPUTS, 'feature_index'),
                         evaluate)],
      test=[],
      main_metric='f1', metric_names=names,
      info={'task': f'squad_{suffix}', 'version_2': version_2})


def beside_output(output_path: str, name: str) -> str:
  """<output without .json>.<name>.json: files that go with a predictions file."""
  stem = output_path[:-len('.json')] if output_path.endswith('.json') else output_path
  return f'{stem}.{name}.json'


def prediction(input_path: str, input_format: str, tok, bert_config: model_lib.BertConfig,
               info: dict, run: ml_collections.ConfigDict, lower_case: bool) -> tasks.Prediction:
  """`bert-jax predict` on a SQuAD-format file: {question id: answer} out (the official
  evaluation script's input) and, beside it, the n-best answers and (v2.0) the no-answer odds;
  official scores for questions with answers. `run` is the fine-tuning run's config (its
  windows and decoding)."""
  del input_format  # Only 'squad'.
  examples = read_squad(input_path, is_training=False)
  features = convert_examples(
      examples, tok, max_seq_length=int(info['max_seq_length']), doc_stride=run.task.doc_stride,
      max_query_length=run.task.max_query_length, is_training=False)

  def finish(rows, output_path):
    scores, answers, null_odds, nbest = answers_and_scores(
        examples, features, rows, run.task, bool(info['version_2']), lower_case)
    fileio.write_text(output_path, json.dumps(answers, indent=2, ensure_ascii=False))
    files = {'nbest': beside_output(output_path, 'nbest')}
    fileio.write_text(files['nbest'], json.dumps(nbest, indent=2, ensure_ascii=False))
    if null_odds is not None:
      files['null_odds'] = beside_output(output_path, 'null_odds')
      fileio.write_text(files['null_odds'], json.dumps(null_odds, indent=2))
    return scores, files
  return tasks.Prediction(
      'squad', len(examples), model_lib.BertForQuestionAnswering(bert_config), 'span',
      tasks.subset(features, tasks.INPUTS, 'feature_index'), finish)
