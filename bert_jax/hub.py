"""The Hugging Face Hub: `hf://` names of checkpoints and corpora, through huggingface_hub.

Names take the path form of huggingface_hub's file system (`HfFileSystem`):

  hf://ORG/NAME[@REVISION][/FOLDER]              a model repository: a checkpoint
  hf://datasets/ORG/NAME[@REVISION]/GLOB         files of a dataset repository: a corpus

REVISION is a branch, a tag or a commit (`refs/pr/N` and `refs/convert/parquet` too, as written
or URL-encoded). Files come through `snapshot_download` into the Hub cache, so its cache
(HF_HOME, HF_HUB_CACHE), its token (HF_TOKEN, `hf auth login`), HF_ENDPOINT and
HF_HUB_OFFLINE=1 work as they do for transformers; only the files a checkpoint or corpus needs
are fetched. A repository that is missing, private or gated without a token, a revision that
does not exist, no network with nothing cached, or a repository that holds no BERT is one
UserError naming the name and the flag that gave it.

huggingface_hub is an optional extra (`pip install "bert_jax[hub]"`), imported on first use.
`is_hub` says whether a path is one of these names: every reader that takes a checkpoint or
an input resolves it here first, and never passes it on to another file system.
"""

import dataclasses
import glob
import json
import os
import re
import urllib.parse

from bert_jax import errors
from bert_jax.errors import UserError

SCHEME = 'hf://'
# The revision part: refs/pr/N and refs/convert/* hold '/', as HfFileSystem reads them.
_NAME = re.compile(r'(?:(?P<kind>datasets)/)?(?P<repo>[^/@]+/[^/@]+)'
                   r'(?:@(?P<revision>refs/(?:pr|convert)/[^/]+|[^/]+))?(?:/(?P<path>.*))?')
# What a checkpoint of any format bert_jax reads may hold (a repository's other files, other
# frameworks' weights, ONNX exports ..., are not fetched).
_CHECKPOINT_FILES = ('config.json', 'bert_config.json', 'bert_jax.json', 'vocab.txt',
                     'tokenizer_config.json', 'special_tokens_map.json', 'task.json',
                     'model.safetensors', 'model-*-of-*.safetensors',
                     'model.safetensors.index.json', 'bert_model.ckpt*', 'checkpoint',
                     'params/*')
# Fetched only for a Hugging Face checkpoint without safetensors weights (older repositories).
_PYTORCH_FILES = ('pytorch_model.bin', 'pytorch_model-*-of-*.bin', 'pytorch_model.bin.index.json')


@dataclasses.dataclass(frozen=True)
class HubName:
  """A parsed hf:// name."""
  kind: str  # 'model' or 'dataset'.
  repo_id: str
  revision: str | None
  path: str  # In the repository: a folder (a checkpoint) or a glob (a corpus); '' = the top.

  def __str__(self) -> str:
    kind = 'datasets/' if self.kind == 'dataset' else ''
    revision = f'@{self.revision}' if self.revision else ''
    return f'{SCHEME}{kind}{self.repo_id}{revision}{"/" + self.path if self.path else ""}'


def is_hub(path: str) -> bool:
  """Whether `path` names something on the Hugging Face Hub (hf://...)."""
  return isinstance(path, str) and path.startswith(SCHEME)


def parse(name: str, flag: str) -> HubName:
  """`hf://[datasets/]ORG/NAME[@REVISION][/PATH]` -> HubName; a malformed one is a UserError
  naming `flag`."""
  m = _NAME.fullmatch(name[len(SCHEME):])
  if not m:
    raise UserError(f'{flag}={name}: expected hf://ORG/NAME[@REVISION] (a model) or '
                    'hf://datasets/ORG/NAME[@REVISION]/GLOB (dataset files)')
  revision = urllib.parse.unquote(m['revision']) if m['revision'] else None
  return HubName('dataset' if m['kind'] else 'model', m['repo'], revision,
                 (m['path'] or '').strip('/'))


def _huggingface_hub():
  return errors.require('huggingface_hub', 'hub', 'hf:// names and pushes to the Hub')


def require() -> None:
  """Raises the one-line UserError of a missing `hub` extra, before work that will need it."""
  _huggingface_hub()


def _download(name: HubName, patterns: list[str], flag: str) -> str:
  """The local snapshot folder of `name`'s repository with the files matching `patterns`
  (fetched if missing); huggingface_hub's errors as one line naming `flag`."""
  hf = _huggingface_hub()
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  from huggingface_hub import errors as hf_errors  # pylint: disable=g-import-not-at-top
  where = f'{flag}={name}'
  what = 'dataset' if name.kind == 'dataset' else 'model'
  try:
    return hf.snapshot_download(name.repo_id, repo_type=name.kind, revision=name.revision,
                                allow_patterns=patterns)
  except hf_errors.RevisionNotFoundError as e:
    raise UserError(f'{where}: the {what} repository {name.repo_id} has no revision '
                    f'{name.revision!r} (a branch, tag or commit)') from e
  except hf_errors.RepositoryNotFoundError as e:  # GatedRepoError is one too.
    raise UserError(f'{where}: no {what} repository {name.repo_id} on the Hub that this '
                    'machine may read: it does not exist, or it is private or gated and no '
                    'token with access is set (HF_TOKEN, or `hf auth login`)') from e
  except hf_errors.LocalEntryNotFoundError as e:  # IncompleteSnapshotError is one too.
    offline = constants.HF_HUB_OFFLINE
    how = ('HF_HUB_OFFLINE is set' if offline else
           f'the Hub cannot be reached ({constants.ENDPOINT})')
    partly = ('only partly ' if isinstance(e, hf_errors.IncompleteSnapshotError) else 'not ')
    raise UserError(f'{where}: {how} and {name.repo_id}'
                    f'{"@" + name.revision if name.revision else ""} is {partly}in the Hugging '
                    f'Face cache ({constants.HF_HUB_CACHE}); download it once with network '
                    'access (or set HF_HOME to the cache that holds it)') from e
  except hf_errors.HfHubHTTPError as e:
    first = str(e).strip().split('\n')[0]
    raise UserError(f'{where}: the Hub refused it ({first})') from e


# Checkpoint folders resolved in this process, by name: every reader of one run (casing,
# weights, vocabulary) sees the same commit of a branch, for one request to the Hub.
_FOLDERS: dict[HubName, str] = {}


def _checkpoint_folder(name: HubName, flag: str) -> str:
  if name in _FOLDERS:
    return _FOLDERS[name]
  prefix = f'{name.path}/' if name.path else ''
  folder = _download(name, [prefix + p for p in _CHECKPOINT_FILES], flag)
  folder = os.path.join(folder, name.path) if name.path else folder
  files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
  if 'config.json' in files and not any(f.endswith('.safetensors') for f in files):
    _download(name, [prefix + p for p in _PYTORCH_FILES], flag)
    files = sorted(os.listdir(folder))
  _check_bert(name, folder, files, flag)
  _FOLDERS[name] = folder
  return folder


def _check_bert(name: HubName, folder: str, files: list[str], flag: str) -> None:
  """Refuses a repository (folder) that holds no BERT checkpoint, naming what it holds."""
  if 'bert_jax.json' in files or 'bert_config.json' in files:
    return
  if 'config.json' not in files:
    raise UserError(f'{flag}={name}: not a BERT checkpoint: no config.json, bert_config.json '
                    f'or bert_jax.json in it (it has {", ".join(files[:8]) or "none of its files"})')
  try:
    with open(os.path.join(folder, 'config.json'), encoding='utf-8') as f:
      model_type = json.load(f).get('model_type')
  except (ValueError, AttributeError) as e:
    raise UserError(f'{flag}={name}: its config.json is not a JSON object of a model') from e
  if model_type != 'bert':
    raise UserError(f'{flag}={name}: not a BERT checkpoint: its config.json says model_type '
                    f'{model_type!r}; bert_jax runs BERT (model_type "bert")')


def checkpoint_folder(path: str, flag: str) -> str:
  """The local folder of the checkpoint `path`: for hf://ORG/NAME[@REVISION][/FOLDER] the
  snapshot in the Hub cache (its files fetched once), any other path as it is.

  `flag` names where the path came from (`train.init_checkpoint`, `--checkpoint`) in errors.
  """
  if not is_hub(path):
    return path
  name = parse(path, flag)
  if name.kind != 'model':
    raise UserError(f'{flag}={path}: a dataset repository, not a model; name a model as '
                    'hf://ORG/NAME[@REVISION]')
  return _checkpoint_folder(name, flag)


# Dataset files resolved in this process, by name (as _FOLDERS).
_DATASET_FILES: dict[HubName, list[tuple[str, str]]] = {}


def dataset_files(spec: str, flag: str) -> list[tuple[str, str]]:
  """(local path, identity) of each Parquet file that hf://datasets/ORG/NAME[@REVISION]/GLOB
  names, fetched into the Hub cache once; sorted. The identity,
  hf://datasets/ORG/NAME@COMMIT/PATH, names the file wherever the cache is (a recreated
  machine downloads it to another place, yet it is the same input)."""
  name = parse(spec, flag)
  if name.kind != 'dataset':
    raise UserError(f'{flag}={spec}: a model repository, not a dataset; name the Parquet files '
                    'of a dataset as hf://datasets/ORG/NAME[@REVISION]/GLOB')
  if not name.path.endswith('.parquet'):
    raise UserError(
        f'{flag}={spec}: name the Parquet files in the dataset, as '
        f'hf://datasets/{name.repo_id}/GLOB.parquet (for example .../data/train-*.parquet); a '
        'dataset published in another format has Parquet files at the revision '
        '@refs/convert/parquet (CONFIG/SPLIT/*.parquet)')
  if name in _DATASET_FILES:
    return _DATASET_FILES[name]
  folder = _download(name, [name.path], flag)
  commit = os.path.basename(folder.rstrip('/'))
  matched = sorted(glob.glob(os.path.join(glob.escape(folder), name.path), recursive=True))
  if not matched:
    raise UserError(f'{flag}={spec}: matches no file of the dataset {name.repo_id}'
                    f'{"@" + name.revision if name.revision else ""}')
  files = [(path, f'{SCHEME}datasets/{name.repo_id}@{commit}/{os.path.relpath(path, folder)}')
           for path in matched]
  _DATASET_FILES[name] = files
  return files


def push_folder(folder: str, repo_id: str, message: str, tag: str = '',
                flag: str = '--push_to_hub') -> str:
  """Commits the local `folder` as the whole tree of the model repository `repo_id` (created if
  missing, with the account's default visibility, as transformers' push_to_hub), its files that the folder lacks deleted, tagged `tag` if given;
  returns the commit's id. A refusal (no token, no write access, no network) is a UserError
  naming `flag`."""
  hf = _huggingface_hub()
  from huggingface_hub import errors as hf_errors  # pylint: disable=g-import-not-at-top
  if not re.fullmatch(r'[\w.-]+/[\w.-]+', repo_id):
    raise UserError(f'{flag}={repo_id}: expected ORG/NAME, a model repository on the Hub')
  api = hf.HfApi()
  try:
    api.create_repo(repo_id, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=message,
                               delete_patterns=['*'])
    if tag:
      api.create_tag(repo_id, tag=tag, revision=commit.oid, tag_message=message,
                     exist_ok=True)
  except (hf_errors.HfHubHTTPError, hf_errors.OfflineModeIsEnabled, OSError) as e:
    first = str(e).strip().split('\n')[0]
    raise UserError(f'{flag}={repo_id}: the Hub refused the push ({type(e).__name__}: '
                    f'{first})') from e
  return commit.oid
