"""What Cloud Storage (gs://) offers beyond `tf.io.gfile`: atomic preconditions, server-side
appends, and access errors a user can read.

`tf.io.gfile` reads and writes gs:// objects, but an object store has no exclusive create and no
append: gfile's append downloads the whole object and uploads it again. Here, through
google-cloud-storage:
  - `create_if_absent`, `replace_if_generation`, `delete_if_generation`: writes that succeed only
    when the object is as the caller last saw it (generation preconditions), for the workdir
    lock;
  - `append`: uploads the new bytes as a small object and composes it onto the end of the
    object server-side, so an append costs the same whether the object holds 1 KB or 1 GB;
  - `check_access`: a bucket that does not exist, missing credentials or a missing permission as
    one UserError naming the path and the fix, before a run starts.
The client follows google-cloud-storage's rules (Application Default Credentials;
STORAGE_EMULATOR_HOST for a test server).
"""

import contextlib
import functools
import os
import re
import urllib.parse
from typing import Any
import uuid

from bert_jax.errors import Outage
from bert_jax.errors import UserError

_FIX_CREDENTIALS = ('give this machine Google credentials: `gcloud auth application-default '
                    'login`, or run on a Cloud VM whose service account has access')


def is_gcs(path: str) -> bool:
  return path.startswith('gs://')


def split(path: str) -> tuple[str, str]:
  """gs://bucket/a/b -> ('bucket', 'a/b')."""
  bucket, _, name = path[len('gs://'):].partition('/')
  return bucket, name


@functools.cache
def client():
  from google.cloud import storage  # pylint: disable=g-import-not-at-top
  return storage.Client()


def _blob(path: str):
  bucket, name = split(path)
  return client().bucket(bucket).blob(name)


def _precondition_failed(error: BaseException) -> bool:
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  return isinstance(error, (exceptions.PreconditionFailed, exceptions.NotFound))


def read(path: str) -> tuple[bytes, int] | None:
  """(contents, generation) of an object, or None if there is none."""
  blob = client().bucket(split(path)[0]).get_blob(split(path)[1], retry=_retry())
  if blob is None:
    return None
  try:
    return (blob.download_as_bytes(if_generation_match=blob.generation, retry=_retry()),
            blob.generation)
  except Exception as e:  # pylint: disable=broad-except
    if _precondition_failed(e):
      return None  # Replaced or deleted between the two requests: as if absent now.
    raise


def _upload(blob: Any, data: bytes, generation: int, path: str) -> None:
  """Uploads `data` as `blob` if its generation is `generation` (0: absent). A failure names
  `path` (`failing_object`): an upload's URL holds no object name, so its RetryError
  named none, and a store down at an append ended in a traceback."""
  try:
    blob.upload_from_string(data, if_generation_match=generation, retry=_retry())
  except Exception as e:  # pylint: disable=broad-except  (raised again, with the path)
    e.gcs_path = path
    raise


def create_if_absent(path: str, data: bytes) -> int | None:
  """Writes a new object; its generation, or None if the object exists (atomic)."""
  blob = _blob(path)
  try:
    _upload(blob, data, 0, path)
  except Exception as e:  # pylint: disable=broad-except
    if _precondition_failed(e):
      return None
    raise
  return blob.generation


def replace_if_generation(path: str, data: bytes, generation: int) -> int | None:
  """Replaces the object if it is still at `generation`; the new generation, or None."""
  blob = _blob(path)
  try:
    _upload(blob, data, generation, path)
  except Exception as e:  # pylint: disable=broad-except
    if _precondition_failed(e):
      return None
    raise
  return blob.generation


def delete_if_generation(path: str, generation: int) -> bool:
  """Deletes the object if it is still at `generation` (fake-gcs-server, the tests' server,
  ignores this precondition; Cloud Storage honours it)."""
  try:
    _blob(path).delete(if_generation_match=generation, retry=_retry())
  except Exception as e:  # pylint: disable=broad-except
    if _precondition_failed(e):
      return False
    raise
  return True


# Objects this process has appended to, and their size after its last append.
_sizes: dict[str, int] = {}


def _retry():
  """google-cloud-storage's retry rule (429, 5xx, dropped connections) on the run's budget
  (`retry_seconds`, TensorFlow's) instead of its own (1 s doubling to 60 s, for 120 s): the
  requests bert_jax makes itself (the lock, appends) are each safe to repeat."""
  from google.cloud.storage import retry as storage_retry  # pylint: disable=g-import-not-at-top
  _, first, longest = retry_budget()
  return storage_retry.DEFAULT_RETRY.with_delay(initial=first, maximum=longest).with_timeout(
      retry_seconds())


def append(path: str, data: bytes) -> None:
  """Appends `data` to the object (creating it): a small upload composed onto its end, so the
  cost does not grow with the object (3 requests). Not atomic against another writer: one
  writer per file.

  google-cloud-storage retries (429, 5xx, dropped connections) only requests that are safe to
  repeat: the part is uploaded if absent (a new name), and the compose, which is not, is retried
  with its retry policy here: before each repeat, the object's size says whether the one before
  landed (its answer lost) or not.
  """
  size = _sizes.get(path)
  if size is None:
    if create_if_absent(path, data) is not None:
      _sizes[path] = len(data)
      return
    size = _stat_size(path)
  bucket = client().bucket(split(path)[0])
  part = bucket.blob(f'{split(path)[1]}.part-{uuid.uuid4().hex}')
  _upload(part, data, 0, path)  # Named as the object appended to.
  try:
    _sizes[path] = _compose_once(path, part, size, len(data))
  finally:
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    with contextlib.suppress(exceptions.NotFound):  # A retried delete whose first try landed.
      part.delete(retry=_retry())


def _stat_size(path: str) -> int:
  blob = client().bucket(split(path)[0]).get_blob(split(path)[1], retry=_retry())
  if blob is None:
    raise FileNotFoundError(f'{path}: deleted while this process appends to it')
  return blob.size


def _compose_once(path: str, part, size: int, added: int) -> int:
  """Composes `part` onto the object of `size` bytes, exactly once, under google-cloud-storage's
  own retry policy (`DEFAULT_RETRY`) on the run's budget (`_retry`); the object's new size.

  (A compose conditional on the object's generation would make the library's conditional retry
  safe by itself; fake-gcs-server, the tests' server, neither changes an object's generation on
  a compose nor checks the condition, so a lost answer's repeat could not be tested.)
  """
  tried = []

  def attempt() -> int:
    if tried:  # A repeat: did the last try land, its answer lost?
      now = _stat_size(path)
      if now == size + added:
        return now
      if now != size:
        raise RuntimeError(f'{path}: {now} bytes after appending {added} to {size}: another '
                           'process writes to it')
    tried.append(True)
    target = _blob(path)
    target.compose([target, part], retry=None)
    return target.size

  return _retry()(attempt)()


def _reason(error: BaseException) -> str:
  """Cloud Storage's own words for a refusal: the "message" of its JSON error (which
  google-cloud-storage keeps in `errors`, and TensorFlow quotes in its text), else the first
  line of the error."""
  if isinstance(getattr(error, 'cause', None), BaseException):
    return _reason(error.cause)  # google-api-core's RetryError: the last attempt's error.
  for detail in getattr(error, 'errors', None) or []:
    if isinstance(detail, dict) and detail.get('message'):
      return detail['message']
  # An upload's InvalidResponse keeps the answer (requests') whole.
  body = getattr(getattr(error, 'response', None), 'text', None)
  text = body if isinstance(body, str) and '"message"' in body else (
      getattr(error, 'message', None) or str(error))
  if match := re.search(r'"message":\s*"((?:[^"\\]|\\.)*)"', text):
    return match.group(1).replace('\\"', '"')
  # tensorstore quotes the response's body with its quotes escaped.
  if match := re.search(r'\\"message\\":\s*\\"(.*?)\\"', text):
    return match.group(1)
  return (text.strip().splitlines() or [type(error).__name__])[0][:300]


def no_permission(path: str, flag: str, error: BaseException, write: bool = False) -> UserError:
  """The UserError for a request on `path` that Cloud Storage refused (403): names `flag` (if
  any), the path, the server's reason, and the role to grant."""
  bucket = split(path)[0]
  where = f'{flag}={path}' if flag else path
  role = 'roles/storage.objectAdmin' if write else 'roles/storage.objectViewer'
  return UserError(
      f'{where}: no permission to {"write to" if write else "read"} gs://{bucket} '
      f'({_reason(error)}); grant this machine\'s account {role} on the bucket (`gcloud storage '
      f'buckets add-iam-policy-binding gs://{bucket} --member=... --role={role}`), or '
      f'{_FIX_CREDENTIALS}')


def _refused(error: BaseException) -> bool:
  """Whether `error` is Cloud Storage refusing access: TensorFlow's PermissionDeniedError,
  google-cloud-storage's Forbidden, tensorstore's PERMISSION_DENIED."""
  name = type(error).__name__
  return (name in ('PermissionDeniedError', 'Forbidden') or
          'PERMISSION_DENIED' in str(error) or 'HTTP response code 403' in str(error))


def denied(error: BaseException) -> UserError | None:
  """The UserError for a Cloud Storage refusal anywhere in `error`'s chain, naming the gs://
  path the error names (TensorFlow and tensorstore quote it; google-cloud-storage's URL holds
  the bucket); None for anything else, a local permission error included."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    text = str(error)
    if _refused(error):
      if match := re.search(r'gs://[^\s\'"]+', text):
        return no_permission(match.group(0).rstrip('.,;:)'), '', error,
                             write=bool(re.search(r'\b(upload|writ|creat|delet)', text, re.I)))
      if match := re.search(r'/storage/v1/b/([^/?\s]+)', text):
        return no_permission(f'gs://{match.group(1)}', '', error,
                             write=bool(re.search(r'\b(POST|PUT|PATCH|DELETE) https?://', text)))
    error = error.__cause__ or error.__context__
  return None


# TensorFlow's Cloud Storage retries (its RetryConfig defaults, read from the environment by
# its file system) and the variables that change them: 10 retries, 1 s doubling to 32 s.
_TF_RETRY_DEFAULTS = {'GCS_RETRY_CONFIG_MAX_RETRIES': 10,
                      'GCS_RETRY_CONFIG_INIT_DELAY_TIME_US': 1_000_000,
                      'GCS_RETRY_CONFIG_MAX_DELAY_TIME_US': 32_000_000}


def retry_budget() -> tuple[int, float, float]:
  """(retries, first delay s, longest delay s) of a request to Cloud Storage: TensorFlow's
  GCS_RETRY_CONFIG_* variables, or its defaults. tensorstore (a checkpoint's arrays) is given
  the same (`tensorstore_retries`), so that one setting bounds how long a run waits on a store
  that keeps failing."""
  values = []
  for name, default in _TF_RETRY_DEFAULTS.items():
    try:
      values.append(int(os.environ.get(name) or default))
    except ValueError:
      raise UserError(f'{name}={os.environ[name]!r}: not a whole number') from None
  retries, first, longest = values
  return retries, first / 1e6, longest / 1e6


def retry_seconds() -> float:
  """The longest a request waits between its retries in all (`retry_budget`): 1 + 2 + ... s,
  each at most the longest delay; 191 s with TensorFlow's defaults."""
  retries, first, longest = retry_budget()
  return sum(min(first * 2**i, longest) for i in range(retries))


def tensorstore_retries() -> dict[str, Any]:
  """tensorstore's `gcs_request_retries` context resource for `retry_budget`: in place of its
  own default (32 retries, 1 s doubling to 32 s: about 15 min for one request)."""
  retries, first, longest = retry_budget()
  return {'max_retries': retries, 'initial_delay': f'{first}s', 'max_delay': f'{longest}s'}


def _unavailable(error: BaseException) -> bool:
  """Whether `error` is Cloud Storage failing past a client's retries: 429/5xx or a dropped
  connection from google-cloud-storage (or its RetryError), TensorFlow's UnavailableError (or
  the AbortedError of its exhausted retries), tensorstore's UNAVAILABLE (or the ABORTED of its
  exhausted retries)."""
  name, text = type(error).__name__, str(error)
  if name in ('AbortedError', 'ValueError') and 'retry attempts failed' in text:
    # TensorFlow's file system past its GCS_RETRY_CONFIG_MAX_RETRIES; tensorstore past its
    # gcs_request_retries ("ABORTED: ... All 32 retry attempts failed").
    return True
  return (name in ('UnavailableError', 'RetryError', 'TooManyRequests', 'ServiceUnavailable',
                   'InternalServerError', 'BadGateway', 'GatewayTimeout') or
          (name == 'ValueError' and text.startswith('UNAVAILABLE')))


def failing_object(error: BaseException) -> tuple[str, str] | None:
  """(gs:// path, Cloud Storage's reason) of Cloud Storage failing past the retries of the
  client that met it anywhere in `error`'s chain (TensorFlow and tensorstore quote the path;
  google-cloud-storage's URL holds it); None for anything else."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    text = str(error)
    if _unavailable(error):
      path = ''
      if match := re.search(r'gs://[^\s\'"]+', text):
        path = match.group(0).rstrip('.,;:)')
      elif match := re.search(r'/b/([^/?\s]+)/o/([^/?\s]+)', text):
        path = f'gs://{match.group(1)}/{urllib.parse.unquote(match.group(2))}'
      else:
        path = getattr(error, 'gcs_path', '')  # An upload's (`_upload`).
      if path:
        return path, _reason(error)
    error = error.__cause__ or error.__context__
  return None


def outage_message(path: str, reason: str, intact: str = 'the last committed checkpoint') -> str:
  """The one line for Cloud Storage failing on `path` past the retries (`failing_object`)."""
  return (f'{path}: Cloud Storage kept failing ({reason}) past the retries (README: Cloud '
          f'Storage); {intact} is intact: rerun the same command to resume once Cloud Storage '
          'answers')


def outage(error: BaseException, intact: str = 'the last committed checkpoint'
           ) -> Outage | None:
  """One line for Cloud Storage failing past the retries of the client that met it, naming the
  object (`failing_object`) and saying that `intact` is; None for anything else."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    if isinstance(error, Outage):
      return error  # Named already (checkpoint._save_failed says which step is intact).
    error = error.__cause__ or error.__context__
  failing = failing_object(seen[0]) if seen else None
  return Outage(outage_message(*failing, intact)) if failing else None


# How long the access check retries a Cloud Storage it cannot reach (the client's own default
# is 120 s, then a traceback), and waits to connect. A server that took the connection is
# reachable: its answer gets the client's own 60 s, so a refusal on a loaded machine stays a
# refusal rather than 'cannot be reached'.
CHECK_DEADLINE_S = 30.0
_READ_TIMEOUT_S = 60.0


def check_access(path: str, flag: str, write: bool = False) -> None:
  """Lists one object under `path` (a glob: under its part before the first wildcard): a missing
  bucket, no credentials or no permission becomes a
  UserError naming `flag`, the path and the fix (`write`: the path is to be written, so the
  role to grant is objectAdmin)."""
  from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
  import google.auth.exceptions  # pylint: disable=g-import-not-at-top
  import requests  # pylint: disable=g-import-not-at-top
  from google.cloud.storage import retry as storage_retry  # pylint: disable=g-import-not-at-top
  bucket, name = split(path)
  where = f'{flag}={path}' if flag else path
  try:
    prefix = re.split(r'[*?[]', name, maxsplit=1)[0]
    retry = storage_retry.DEFAULT_RETRY.with_timeout(CHECK_DEADLINE_S)
    next(iter(client().list_blobs(bucket, prefix=prefix, max_results=1, retry=retry,
                                  timeout=(CHECK_DEADLINE_S, _READ_TIMEOUT_S))), None)
  except (exceptions.RetryError, requests.exceptions.ConnectionError,
          google.auth.exceptions.TransportError) as e:
    cause = e.cause if isinstance(e, exceptions.RetryError) and e.cause is not None else e
    reason = re.sub(r'.*\] ?', '', str(cause).split('Caused by ')[-1]).rstrip('"\')) ')[:200]
    raise UserError(f'{where}: Cloud Storage cannot be reached ({reason or type(cause).__name__};'
                    f' retried for {CHECK_DEADLINE_S:.0f} s): check this machine\'s network and '
                    'proxy settings (https_proxy), or STORAGE_EMULATOR_HOST') from e
  except google.auth.exceptions.GoogleAuthError as e:
    raise UserError(f'{where}: no Google credentials to reach Cloud Storage ({e}); '
                    f'{_FIX_CREDENTIALS}') from e
  except exceptions.NotFound as e:
    raise UserError(f'{where}: the bucket gs://{bucket} does not exist; create it (`gcloud '
                    f'storage buckets create gs://{bucket}`) or fix the name') from e
  except (exceptions.Forbidden, exceptions.Unauthorized) as e:
    raise no_permission(path, flag, e, write) from e
