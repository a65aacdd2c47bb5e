r"""Runs bert_jax on Cloud TPU VMs and pod slices by shelling out to `gcloud`.

Subcommands (every one takes --dry_run, which prints the commands, one per line, and runs
nothing):

  create  Create the TPU: a queued resource (--api=queued, the default) or a TPU VM
          (--api=tpu-vm); waits until it is ready.
  setup   Install bert_jax on every worker and copy the config file (and the .py files beside
          it, which a user's config may import) to every worker; a shipped config's name
          (--config=finetune_glue:mrpc) copies nothing.
  run     Run `bert-jax pretrain|finetune` on every worker; output streams back over ssh and is
          also appended to a log file on each worker. --relaunch: see `watch`.
watch   Same as `run --relaunch`: run, and whenever the TPU is preempted (or missing) delete it,
          create it again, set it up and run again, up to --max_restarts times; a run that exits
          with status 143 (stopped by SIGTERM) on a healthy TPU is run again as it is. The same
          --workdir makes every relaunch resume from the latest checkpoint. Started with no TPU, it
          creates and sets one up first.
  delete  Delete the TPU (and its queued resource).

Examples (a v4-32 slice is 4 hosts, so the workdir must be on GCS):

  F="--name=bert-large --zone=us-central2-b --accelerator_type=v4-32 --capacity=spot"
  python launch/tpu.py create $F
  python launch/tpu.py setup $F --config=configs/bert_large.py
  python launch/tpu.py run $F --config=configs/bert_large.py \
      --workdir=gs://my-bucket/bert_large --config.train.batch_size=1024
  python launch/tpu.py watch $F --config=configs/bert_large.py \
      --workdir=gs://my-bucket/bert_large --max_restarts=20
  python launch/tpu.py delete $F

  # v5e: `v5e-256` is accepted and becomes the gcloud name `v5litepod-256`.
  python launch/tpu.py watch --name=bert-v5e --zone=us-west4-a --accelerator_type=v5e-256 \
      --capacity=spot --config=configs/bert_base.py --workdir=gs://my-bucket/bert_base

What gets installed (--install): a directory (default: this checkout) is built into a wheel
locally, copied to the workers and installed with the `[tpu]` extra; a .whl or .tar.gz file is
copied and installed; anything else is a pip requirement installed as written, for example
--install='bert_jax[tpu] @ git+https://github.com/ORG/bert_jax@v0.1.0'.

Configs and logs live in --remote_dir (default `bert_jax_run`, under the remote home): a config
file is run as `configs/<file>.py` there, and output is appended to `logs/<mode>.log`.
Run this launcher inside tmux/screen for long runs: training stops when the ssh session does.
"""

import argparse
import configparser
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Default runtime (software) version per TPU generation.
RUNTIME_VERSIONS = {
    'v4': 'tpu-ubuntu2204-base',
    'v5e': 'v2-alpha-tpuv5-lite',
    'v5p': 'v2-alpha-tpuv5',
    'v6e': 'v2-alpha-tpuv6e',
}
# v5e/v6e slices are named by chip count and only come in these sizes.
_LITE_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)
_CAPACITIES = ('on-demand', 'spot', 'preemptible', 'reserved', 'best-effort')

# States read from `describe --format=value(...)`: a queued resource reports ACTIVE once its
# nodes are up, a TPU VM reports READY.
HEALTHY_STATES = frozenset({'READY', 'ACTIVE'})
# `bert-jax`'s status for "stopped by SIGTERM, rerun to resume" (bert_jax.errors.EXIT_PREEMPTED;
# this script imports nothing of the package): a maintenance event or a stop on a TPU that is
# still healthy is relaunched on it, without recreating the TPU.
PREEMPTED_STATUS = 143
PENDING_STATES = frozenset({
    'CREATING', 'STARTING', 'RESTARTING', 'REPAIRING', 'REIMAGING', 'UPDATING',
    'ACCEPTED', 'WAITING_FOR_RESOURCES', 'PROVISIONING', 'UNKNOWN',
})
MISSING = 'MISSING'  # describe answered NOT_FOUND.
# Anything else (PREEMPTED, SUSPENDING, SUSPENDED, FAILED, TERMINATED, STOPPED, DELETING,
# MISSING) means the TPU has to be deleted and created again.


class LaunchError(ValueError):
  """A bad flag or an unrecoverable launch failure; the message names what to fix."""


# ---- Accelerator types --------------------------------------------------------------------


def normalize_accelerator_type(name: str) -> str:
  """Validates an accelerator type and returns its gcloud name (`v5e-N` -> `v5litepod-N`)."""
  match = re.fullmatch(r'(v4|v5p|v5e|v5litepod|v6e)-(\d+)', name or '')
  if not match:
    raise LaunchError(
        f'--accelerator_type: {name!r} is not a supported TPU type; use v4-N (N = TensorCores, '
        f'8..4096), v5p-N (8..17920), v5e-N / v5litepod-N or v6e-N (N in {list(_LITE_SIZES)})')
  family, size = match.group(1), int(match.group(2))
  if family in ('v4', 'v5p'):
    # v4 and v5p are named by TensorCores: two per chip, four chips per host.
    limit = 4096 if family == 'v4' else 17920
    if size % 8 or not 8 <= size <= limit:
      raise LaunchError(f'--accelerator_type: {name!r}: {family} sizes are multiples of 8 '
                        f'TensorCores from {family}-8 to {family}-{limit}')
    return f'{family}-{size}'
  if size not in _LITE_SIZES:
    raise LaunchError(f'--accelerator_type: {name!r}: {family} sizes are {list(_LITE_SIZES)}')
  return f'{"v6e" if family == "v6e" else "v5litepod"}-{size}'


def tpu_generation(accelerator_type: str) -> str:
  """Returns 'v4', 'v5e', 'v5p' or 'v6e' for a normalized accelerator type."""
  family = accelerator_type.split('-')[0]
  return 'v5e' if family == 'v5litepod' else family


def num_hosts(accelerator_type: str) -> int:
  """Number of TPU VMs (workers, JAX processes) in a slice of this type."""
  generation = tpu_generation(accelerator_type)
  size = int(accelerator_type.split('-')[1])
  if generation in ('v4', 'v5p'):
    return max(1, size // 8)
  # v5e/v6e: up to 8 chips fit on one host; larger slices have 4 chips per host.
  return 1 if size <= 8 else size // 4


# ---- Flags ----------------------------------------------------------------------------------


_SUBCOMMANDS = {
    'create': 'create the TPU and wait until it is ready',
    'setup': 'install bert_jax and copy the configs on every worker',
    'run': 'run bert-jax on every worker (--relaunch: as watch)',
    'watch': 'run, and recreate + set up + rerun after each preemption',
    'delete': 'delete the TPU (and its queued resource)',
}


def _build_parser() -> argparse.ArgumentParser:
  # No abbreviations: `--conf=x` must not quietly mean --config.
  common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  tpu = common.add_argument_group('TPU')
  tpu.add_argument('--name', help='TPU (and queued resource) name. Required.')
  tpu.add_argument('--zone', help='GCP zone, e.g. us-central2-b. Required.')
  tpu.add_argument('--project', default='', help='GCP project; default: gcloud config.')
  tpu.add_argument('--accelerator_type', default='',
                   help='v4-32, v5p-128, v5e-256 (= v5litepod-256), v6e-64, ...')
  tpu.add_argument('--runtime_version', default='',
                   help='TPU software version; default per generation: ' + ', '.join(
                       f'{k}: {v}' for k, v in RUNTIME_VERSIONS.items()))
  tpu.add_argument('--api', choices=('queued', 'tpu-vm'), default='queued',
                   help='`queued`: gcloud compute tpus queued-resources; `tpu-vm`: tpu-vm '
                        'create.')
  tpu.add_argument('--capacity', choices=_CAPACITIES, default='on-demand',
                   help='preemptible: tpu-vm only; best-effort: queued only (gcloud alpha).')
  tpu.add_argument('--node_id', default='',
                   help='Node id inside the queued resource; default: --name.')
  tpu.add_argument('--create_flag', action='append', default=[],
                   help='Extra flag for the create command, repeatable, e.g. '
                        '--create_flag=--network=my-net.')
  tpu.add_argument('--internal_ip', action='store_true',
                   help='ssh/scp over internal IPs (launching from a VM in the same VPC).')
  job = common.add_argument_group('job')
  job.add_argument('--config', default='',
                   help='Local config file, e.g. configs/bert_large.py, copied to the workers, '
                        'or the name of a shipped config, e.g. finetune_glue (the installed '
                        'package has it); an optional `:arg` suffix is passed on.')
  job.add_argument('--workdir', default='',
                   help='Checkpoints and logs; must be gs://... on a multi-host slice and '
                        'with watch / --relaunch (new VMs do not keep a local one).')
  job.add_argument('--shared_workdir', action='store_true',
                   help='--workdir is a path every worker sees and that outlives the VMs (a '
                        'gcsfuse, Filestore or NFS mount set up on each worker): allowed where '
                        'a gs:// workdir is otherwise required.')
  job.add_argument('--mode', choices=('pretrain', 'finetune'), default='pretrain',
                   help='bert-jax subcommand.')
  job.add_argument('--env', action='append', default=[],
                   help='KEY=VALUE exported on every worker before the run, repeatable.')
  job.add_argument('--install', default=_REPO_ROOT,
                   help='Checkout directory (built into a wheel), .whl/.tar.gz file, or pip '
                        'requirement. Default: this checkout.')
  job.add_argument('--extras', default='tpu',
                   help='pip extras installed with a local checkout/wheel/sdist.')
  job.add_argument('--remote_dir', default='bert_jax_run',
                   help='Directory on each worker (relative to home) for configs and logs.')
  control = common.add_argument_group('control')
  control.add_argument('--dry_run', action='store_true',
                       help='Print the commands, one per line, and run nothing.')
  control.add_argument('--relaunch', action='store_true',
                       help='run: recreate and rerun after a preemption (same as `watch`).')
  control.add_argument('--max_restarts', type=int, default=10,
                       help='Relaunches allowed before giving up.')
  control.add_argument('--poll_seconds', type=float, default=60.0,
                       help='Seconds between state checks while waiting.')
  control.add_argument('--ready_timeout_s', type=float, default=24 * 3600.0,
                       help='Give up if the TPU is not ready this long after creation.')
  control.add_argument('--gcloud', default='gcloud', help='gcloud executable.')

  parser = argparse.ArgumentParser(
      prog='launch/tpu.py', allow_abbrev=False, description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='Overrides such as --config.train.learning_rate=1e-4 and arguments after `--` are '
             'passed to bert-jax unchanged.')
  sub = parser.add_subparsers(dest='subcommand', metavar='SUBCOMMAND', required=True)
  for name, text in _SUBCOMMANDS.items():
    sub.add_parser(name, parents=[common], allow_abbrev=False, help=text, description=text)
  return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Parses and validates the command line (without the program name).

  Returns the argparse namespace with `overrides` (the --config.* flags) and `extra_args` (what
  follows `--`) added, the accelerator type normalized and the runtime version filled in.

  Raises:
    LaunchError: naming the flag that is missing or wrong.
  """
  argv = list(argv)
  extra_args = []
  if '--' in argv:
    cut = argv.index('--')
    argv, extra_args = argv[:cut], argv[cut + 1:]
  args, unknown = _build_parser().parse_known_args(argv)
  overrides = []
  for token in unknown:
    if not re.fullmatch(r'--config\.[A-Za-z0-9_.]+=.*', token):
      raise LaunchError(f'unknown flag {token!r}: launcher flags are listed by --help; config '
                        'overrides must be written --config.key=value')
    overrides.append(token)
  args.overrides, args.extra_args = overrides, extra_args
  if args.subcommand == 'watch':
    args.relaunch = True
  _validate(args)
  return args


def _validate(args: argparse.Namespace) -> None:
  """Checks the flags each subcommand needs; fills in defaults that depend on others."""
  if not args.name:
    raise LaunchError('--name is required (the TPU name)')
  if not re.fullmatch(r'[a-z]([-a-z0-9]{0,61}[a-z0-9])?', args.name):
    raise LaunchError(f'--name: {args.name!r} must be lower-case letters, digits and hyphens, '
                      'start with a letter and be at most 63 characters')
  args.node_id = args.node_id or args.name
  if not args.zone:
    raise LaunchError('--zone is required, e.g. --zone=us-central2-b')
  if not re.fullmatch(r'[a-z]+-[a-z]+[0-9]+-[a-z]', args.zone):
    raise LaunchError(f'--zone: {args.zone!r} is not a zone name such as us-central2-b')
  needs_accelerator = args.subcommand in ('create', 'run', 'watch')
  if needs_accelerator and not args.accelerator_type:
    raise LaunchError(f'--accelerator_type is required for `{args.subcommand}`, e.g. v4-32')
  if args.accelerator_type:
    args.accelerator_type = normalize_accelerator_type(args.accelerator_type)
    args.runtime_version = (args.runtime_version or
                            RUNTIME_VERSIONS[tpu_generation(args.accelerator_type)])
  if args.capacity == 'preemptible' and args.api != 'tpu-vm':
    raise LaunchError('--capacity=preemptible exists only with --api=tpu-vm; use '
                      '--capacity=spot with queued resources')
  if args.capacity == 'best-effort' and args.api != 'queued':
    raise LaunchError('--capacity=best-effort exists only with --api=queued')
  if not re.fullmatch(r'[A-Za-z0-9_.~/-]+', args.remote_dir):
    raise LaunchError(f'--remote_dir: {args.remote_dir!r} may hold only letters, digits and '
                      '_.~/-')
  if args.max_restarts < 0:
    raise LaunchError(f'--max_restarts must be >= 0, got {args.max_restarts}')
  for item in args.env:
    if not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*=.*', item):
      raise LaunchError(f'--env: {item!r} is not KEY=VALUE')
  if args.subcommand in ('setup', 'run', 'watch'):
    if not args.config:
      raise LaunchError(f'--config is required for `{args.subcommand}`, e.g. '
                        '--config=configs/bert_base.py')
    config_file = _config_file(args.config)
    if _is_shipped(config_file):
      shipped = os.path.join(_REPO_ROOT, 'configs')
      names = sorted(f[:-3] for f in os.listdir(shipped) if f.endswith('.py')
                     and not f.startswith('_')) if os.path.isdir(shipped) else []
      if names and config_file not in names:
        raise LaunchError(f'--config: {config_file!r} is neither a config file nor a shipped '
                          f'config ({", ".join(names)})')
    elif not config_file.endswith('.py'):
      raise LaunchError(f'--config: {args.config!r} is not a Python config file (*.py) nor '
                        'the name of a shipped config')
    # setup and relaunches copy the config and install the package, so both must exist here.
    if args.subcommand == 'setup' or args.relaunch:
      if not _is_shipped(config_file) and not os.path.isfile(config_file):
        raise LaunchError(f'--config: file {config_file!r} not found')
      _package_kind(args.install)
  if args.subcommand in ('run', 'watch'):
    if not args.workdir:
      raise LaunchError('--workdir is required, e.g. --workdir=gs://my-bucket/run1')
    hosts = num_hosts(args.accelerator_type)
    shared = args.workdir.startswith('gs://') or args.shared_workdir
    if hosts > 1 and not shared:
      raise LaunchError(
          f'--workdir must be a gs:// path on {args.accelerator_type} ({hosts} hosts): all '
          f'workers write one checkpoint and resume from it; got {args.workdir!r} (a mount '
          'that every worker shares: add --shared_workdir)')
    if args.relaunch and not shared:
      # A relaunch deletes the TPU VMs and creates new ones: their disks, and a workdir on
      # them, are gone, so the rerun would start from scratch instead of resuming.
      raise LaunchError(
          f'--workdir must be a gs:// path with `watch` / `run --relaunch`: a relaunch creates '
          f'new TPU VMs, whose disks do not keep a local workdir to resume from; got '
          f'{args.workdir!r} (a mount that outlives the VMs: add --shared_workdir)')


def _config_file(config: str) -> str:
  """`configs/x.py:arg` -> `configs/x.py`."""
  return config.split(':', 1)[0]


def _is_shipped(config_file: str) -> bool:
  """A bare name (`finetune_glue`): one of the configs installed with the package, which
  `bert-jax` finds itself; nothing to copy."""
  return re.fullmatch(r'[A-Za-z0-9_]+', config_file) is not None


_ARCHIVE_SUFFIXES = ('.whl', '.tar.gz', '.zip')


def _package_kind(install: str) -> str:
  """'checkout', 'archive' or 'requirement' for an --install value; checks files exist."""
  if install.endswith(_ARCHIVE_SUFFIXES):
    if not os.path.isfile(install):
      raise LaunchError(f'--install: file {install!r} not found')
    return 'archive'
  if os.path.isdir(install):
    if not any(os.path.isfile(os.path.join(install, f)) for f in ('setup.cfg', 'pyproject.toml')):
      raise LaunchError(f'--install: directory {install!r} has no setup.cfg or pyproject.toml')
    return 'checkout'
  if install.startswith(('/', './', '../', '~')):
    raise LaunchError(f'--install: directory {install!r} not found')
  return 'requirement'


# ---- Command construction (pure) -----------------------------------------------------------


def _scope(args: argparse.Namespace) -> list[str]:
  return [f'--zone={args.zone}'] + ([f'--project={args.project}'] if args.project else [])


def _ssh_flags(args: argparse.Namespace) -> list[str]:
  # A relaunch talks to freshly created VMs unattended, so it must not stop at a host-key
  # prompt.
  flags = ['--worker=all', '--strict-host-key-checking=no']
  return flags + (['--internal-ip'] if args.internal_ip else [])


def ssh_command(args: argparse.Namespace, remote: str, *, keepalive: bool = False) -> list[str]:
  """`gcloud ... tpu-vm ssh` running `remote` (a shell command line) on every worker."""
  cmd = [args.gcloud, 'compute', 'tpus', 'tpu-vm', 'ssh', args.node_id, *_scope(args),
         *_ssh_flags(args)]
  if keepalive:
    # Without keepalives an ssh session to a preempted VM can sit silent for hours.
    cmd += ['--ssh-flag=-oServerAliveInterval=60', '--ssh-flag=-oServerAliveCountMax=5']
  return cmd + ['--command', remote]


def scp_command(args: argparse.Namespace, sources: Sequence[str], dest: str) -> list[str]:
  """`gcloud ... tpu-vm scp` copying local `sources` to `dest` on every worker."""
  return [args.gcloud, 'compute', 'tpus', 'tpu-vm', 'scp', *sources, f'{args.node_id}:{dest}',
          *_scope(args), *_ssh_flags(args)]


def create_commands(args: argparse.Namespace) -> list[list[str]]:
  """The command that creates the TPU (queued resource or TPU VM)."""
  if args.api == 'queued':
    # --best-effort is only in the alpha track of gcloud.
    track = ['alpha'] if args.capacity == 'best-effort' else []
    cmd = [args.gcloud, *track, 'compute', 'tpus', 'queued-resources', 'create', args.name,
           f'--node-id={args.node_id}', f'--accelerator-type={args.accelerator_type}',
           f'--runtime-version={args.runtime_version}', *_scope(args)]
  else:
    cmd = [args.gcloud, 'compute', 'tpus', 'tpu-vm', 'create', args.name,
           f'--accelerator-type={args.accelerator_type}', f'--version={args.runtime_version}',
           *_scope(args)]
  if args.capacity != 'on-demand':
    cmd.append(f'--{args.capacity}')
  return [cmd + list(args.create_flag)]


def state_command(args: argparse.Namespace) -> list[str]:
  """Prints the TPU's state (ACTIVE/READY when usable); fails with NOT_FOUND when missing."""
  if args.api == 'queued':
    return [args.gcloud, 'compute', 'tpus', 'queued-resources', 'describe', args.name,
            *_scope(args), '--format=value(state.state)']
  return [args.gcloud, 'compute', 'tpus', 'tpu-vm', 'describe', args.name, *_scope(args),
          '--format=value(state)']


def delete_commands(args: argparse.Namespace) -> list[list[str]]:
  """Deletes the TPU; for a queued resource --force deletes its nodes too."""
  if args.api == 'queued':
    return [[args.gcloud, 'compute', 'tpus', 'queued-resources', 'delete', args.name,
             *_scope(args), '--force', '--quiet']]
  return [[args.gcloud, 'compute', 'tpus', 'tpu-vm', 'delete', args.name, *_scope(args),
           '--quiet']]


def wheel_dir() -> str:
  """Local directory the checkout's wheel is built into."""
  return os.path.join(tempfile.gettempdir(), 'bert_jax_launch', 'dist')


def build_wheel_command(checkout: str) -> list[str]:
  """Builds a wheel of `checkout` (bert_jax itself only: --no-deps) into wheel_dir()."""
  return [sys.executable, '-m', 'pip', 'wheel', '--no-deps', f'--wheel-dir={wheel_dir()}',
          checkout]


def expected_wheel(checkout: str) -> str:
  """Path of the wheel that build_wheel_command makes, from the checkout's setup.cfg."""
  meta = configparser.ConfigParser()
  meta.read(os.path.join(checkout, 'setup.cfg'))
  name = meta.get('metadata', 'name', fallback='bert_jax')
  version = meta.get('metadata', 'version', fallback='VERSION')
  return os.path.join(wheel_dir(), f'{re.sub(r"[-_.]+", "_", name)}-{version}-py3-none-any.whl')


def setup_commands(args: argparse.Namespace, package: str) -> list[list[str]]:
  """Copies `package` (a local wheel/sdist, or a pip requirement) and the configs; installs.

  The config's sibling .py files go too, since a user's config may import a module beside it.
  A shipped config's name copies nothing: the installed package has it.
  """
  rd = args.remote_dir
  config_file = _config_file(args.config)
  config_dir = os.path.dirname(config_file) or '.'
  configs = ([] if _is_shipped(config_file) else
             sorted(set(glob.glob(os.path.join(config_dir, '*.py'))) | {config_file}))
  commands = [ssh_command(args, f'rm -rf {shlex.quote(rd)}/configs {shlex.quote(rd)}/dist && '
                                f'mkdir -p {shlex.quote(rd)}/configs {shlex.quote(rd)}/dist '
                                f'{shlex.quote(rd)}/logs')]
  if not package.endswith(_ARCHIVE_SUFFIXES):
    spec = code = package
  else:
    commands.append(scp_command(args, [package], f'{rd}/dist/'))
    code = f'dist/{os.path.basename(package)}'
    spec = f'{code}[{args.extras}]' if args.extras else code
  if configs:
    commands.append(scp_command(args, configs, f'{rd}/configs/'))
  # The first install brings the dependencies; the second replaces bert_jax even when the
  # version number did not change, so the workers always run the code that was given.
  pip = 'python3 -m pip install'
  commands.append(ssh_command(
      args, f'cd {shlex.quote(rd)} && {pip} {shlex.quote(spec)} && '
            f'{pip} --force-reinstall --no-deps {shlex.quote(code)}'))
  return commands


def train_command(args: argparse.Namespace) -> list[str]:
  """The bert-jax command line each worker runs (from --remote_dir)."""
  config_file = _config_file(args.config)
  remote_config = args.config if _is_shipped(config_file) else (
      'configs/' + os.path.basename(config_file) + args.config[len(config_file):])
  # Cloud TPU: jax.distributed.initialize() finds the other workers itself; no coordinator.
  return ['bert-jax', args.mode, f'--config={remote_config}', f'--workdir={args.workdir}',
          *args.overrides, *args.extra_args]


def run_commands(args: argparse.Namespace) -> list[list[str]]:
  """Runs training on every worker, teeing its output into logs/<mode>.log there."""
  rd = shlex.quote(args.remote_dir)
  exports = []
  for item in args.env:
    key, value = item.split('=', 1)
    exports.append(f'export {key}={shlex.quote(value)}')
  remote = ' && '.join([
      f'cd {rd}', 'mkdir -p logs',
      # pip installs console scripts into ~/.local/bin, which a non-login ssh shell lacks.
      'export PATH="$HOME/.local/bin:$PATH"', *exports,
      # pipefail: the exit status is the trainer's, not tee's.
      'set -o pipefail',
      f'{shlex.join(train_command(args))} 2>&1 | tee -a logs/{args.mode}.log'])
  return [ssh_command(args, remote, keepalive=True)]


def relaunch_commands(args: argparse.Namespace, package: str) -> list[list[str]]:
  """What a relaunch after preemption runs: delete, create, (wait), setup, run."""
  return [*delete_commands(args), *create_commands(args), state_command(args),
          *setup_commands(args, package), *run_commands(args)]


# ---- Execution -----------------------------------------------------------------------------


class Shell:
  """Runs commands, or prints them under --dry_run."""

  def __init__(self, dry_run: bool, out=sys.stdout, sleep: Callable[[float], None] = time.sleep):
    self.dry_run = dry_run
    self.out = out
    self.sleep = sleep

  def note(self, text: str) -> None:
    """A comment: part of the dry-run listing, progress on stderr otherwise."""
    if self.dry_run:
      print(f'# {text}', file=self.out, flush=True)
    else:
      print(f'[tpu.py] {text}', file=sys.stderr, flush=True)

  def run(self, cmd: Sequence[str], check: bool = True) -> int:
    if self.dry_run:
      print(shlex.join(cmd), file=self.out, flush=True)
      return 0
    print(f'[tpu.py] $ {shlex.join(cmd)}', file=sys.stderr, flush=True)
    rc = subprocess.run(list(cmd), check=False).returncode
    if check and rc:
      raise LaunchError(f'command failed with exit status {rc}: {shlex.join(cmd)}')
    return rc

  def capture(self, cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=False, capture_output=True, text=True)


def get_state(args: argparse.Namespace, shell: Shell, attempts: int = 5) -> str:
  """The TPU's state, or MISSING; retries transient gcloud failures."""
  cmd = state_command(args)
  for attempt in range(attempts):
    result = shell.capture(cmd)
    if result.returncode == 0:
      # An empty state shows up briefly while a resource changes; wait it out like CREATING.
      return result.stdout.strip().upper() or 'UNKNOWN'
    if re.search(r'NOT_FOUND|not found', result.stderr):
      return MISSING
    shell.note(f'state query failed ({attempt + 1}/{attempts}): {result.stderr.strip()}')
    shell.sleep(args.poll_seconds)
  raise LaunchError(f'cannot read the TPU state with: {shlex.join(cmd)}')


def wait_ready(args: argparse.Namespace, shell: Shell) -> None:
  """Polls until the TPU is READY/ACTIVE; raises if it fails or --ready_timeout_s passes."""
  if shell.dry_run:
    shell.note('poll until the state is READY (tpu-vm) or ACTIVE (queued resource):')
    shell.run(state_command(args))
    return
  deadline = time.monotonic() + args.ready_timeout_s
  last = None
  while True:
    state = get_state(args, shell)
    if state != last:
      shell.note(f'{args.name}: {state}')
      last = state
    if state in HEALTHY_STATES:
      return
    if state not in PENDING_STATES:
      raise LaunchError(f'TPU {args.name} went to state {state} while being created; see '
                        f'`{shlex.join(state_command(args)[:-1])}`')
    if time.monotonic() > deadline:
      raise LaunchError(f'TPU {args.name} not ready after --ready_timeout_s='
                        f'{args.ready_timeout_s:g} (state {state})')
    shell.sleep(args.poll_seconds)


def settled_state(args: argparse.Namespace, shell: Shell) -> tuple[str, bool]:
  """Waits out pending states (REPAIRING after maintenance, PROVISIONING, ...).

  Returns:
    The first state that is not pending, and whether any pending state was seen.
  """
  deadline = time.monotonic() + args.ready_timeout_s
  state, waited = get_state(args, shell), False
  while state in PENDING_STATES:
    if time.monotonic() > deadline:
      raise LaunchError(f'TPU {args.name} still {state} after --ready_timeout_s='
                        f'{args.ready_timeout_s:g}')
    waited = True
    shell.sleep(args.poll_seconds)
    state = get_state(args, shell)
  return state, waited


def wait_gone(args: argparse.Namespace, shell: Shell) -> None:
  """Polls until the TPU no longer exists, so its name can be reused."""
  deadline = time.monotonic() + args.ready_timeout_s
  while get_state(args, shell) != MISSING:
    if time.monotonic() > deadline:
      raise LaunchError(f'TPU {args.name} still exists --ready_timeout_s after deletion')
    shell.sleep(args.poll_seconds)


def prepare_package(args: argparse.Namespace, shell: Shell) -> str:
  """Builds the checkout's wheel when --install is a directory; returns what to install."""
  kind = _package_kind(args.install)
  if kind != 'checkout':
    return args.install
  if not shell.dry_run:
    for old in glob.glob(os.path.join(wheel_dir(), '*.whl')):
      os.remove(old)
  shell.run(build_wheel_command(args.install))
  if shell.dry_run:
    return expected_wheel(args.install)
  wheels = glob.glob(os.path.join(wheel_dir(), '*.whl'))
  if len(wheels) != 1:
    raise LaunchError(f'expected one wheel in {wheel_dir()} after building {args.install}, '
                      f'found {wheels}')
  return wheels[0]


def create(args: argparse.Namespace, shell: Shell) -> None:
  for cmd in create_commands(args):
    shell.run(cmd)
  wait_ready(args, shell)


def setup(args: argparse.Namespace, shell: Shell, package: str) -> None:
  for cmd in setup_commands(args, package):
    shell.run(cmd)


def recreate(args: argparse.Namespace, shell: Shell, package: str, state: str) -> None:
  """Deletes the TPU if anything of it is left, creates it again and sets it up."""
  if state != MISSING:
    if state != 'DELETING':
      for cmd in delete_commands(args):
        shell.run(cmd)
    wait_gone(args, shell)
  create(args, shell)
  setup(args, shell, package)


def run(args: argparse.Namespace, shell: Shell) -> int:
  """Runs training; returns the exit status of the ssh session."""
  status = 0
  for cmd in run_commands(args):
    status = status or shell.run(cmd, check=False)
  return status


def watch(args: argparse.Namespace, shell: Shell) -> int:
  """Runs training, recreating the TPU after each preemption, up to --max_restarts times."""
  package = prepare_package(args, shell)
  if shell.dry_run:
    shell.note('check the state (READY/ACTIVE: run now; missing or preempted: recreate first):')
    shell.run(state_command(args))
    run(args, shell)
    shell.note(f'after the run, unless the state is READY/ACTIVE (preempted, suspended, failed '
               f'or missing), relaunch, up to --max_restarts={args.max_restarts} times:')
    for cmd in relaunch_commands(args, package):
      shell.run(cmd)
    return 0
  state, _ = settled_state(args, shell)
  if state not in HEALTHY_STATES:
    shell.note(f'{args.name} is {state}: creating it')
    recreate(args, shell, package, state)
  restarts = 0
  while True:
    status = run(args, shell)
    state, interrupted = settled_state(args, shell)
    stopped = status == PREEMPTED_STATUS or (status and interrupted)
    if state in HEALTHY_STATES and not stopped:
      if status:
        # The TPU is fine, so the failure is the program's: rerunning would fail again.
        raise LaunchError(f'training exited with status {status} on a healthy TPU; not '
                          f'relaunching (see logs/{args.mode}.log on the workers)')
      shell.note('training finished')
      return 0
    if restarts >= args.max_restarts:
      raise LaunchError(f'TPU {args.name} is {state} and --max_restarts={args.max_restarts} '
                        'relaunches are used up')
    restarts += 1
    shell.note(f'{args.name} is {state} (exit status {status}): relaunch {restarts}/'
               f'{args.max_restarts}, resuming from {args.workdir}')
    if state not in HEALTHY_STATES:  # Healthy again after a repair: the VMs are still set up.
      recreate(args, shell, package, state)


def main(argv: Sequence[str] | None = None, shell: Shell | None = None) -> int:
  """Command-line entry point; returns the exit status."""
  argv = sys.argv[1:] if argv is None else argv
  try:
    args = parse_args(argv)
    shell = shell or Shell(args.dry_run)
    if args.subcommand == 'create':
      create(args, shell)
    elif args.subcommand == 'setup':
      setup(args, shell, prepare_package(args, shell))
    elif args.subcommand == 'run' and not args.relaunch:
      return run(args, shell)
    elif args.subcommand in ('run', 'watch'):
      return watch(args, shell)
    elif args.subcommand == 'delete':
      for cmd in delete_commands(args):
        shell.run(cmd)
  except LaunchError as e:
    print(f'launch/tpu.py: error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
