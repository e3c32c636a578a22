"""``fusionrun``: start a training script on N ranks through the environment's ``mpiexec``.

::

    fusionrun -np 4 python train.py --epochs 3
    fusionrun -np 4 --slow 1:3 python train.py               # rank 1 computes 3x slower
    fusionrun -np 4 --cluster 4 --rate 1gbit python train.py  # one rank per emulated host
    fusionrun -np 2 --dry-run -hosts a,b python train.py      # print the command, run nothing
    fusionrun -np 8 -H a:4,b:4 --fusion-threshold-mb 32 python train.py  # horovodrun's words

Options it does not know are handed to ``mpiexec`` unchanged; the program starts at the first token that
is not an option or an option's value (or after ``--``). The exit code is ``mpiexec``'s.

``horovodrun``'s host and tuning options are understood too, so a Horovod launch line works with only its
first word changed: ``-H/--hosts HOST:SLOTS,...`` and ``--hostfile FILE`` (lines ``HOST slots=N``, or
``HOST:N``) become the MPI's own host list, and the tuning options become ``FUSIONRING_*`` variables for
every rank (see :mod:`fusionring.horovodrun`, which also says what each other horovodrun option
becomes).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fusionring import cluster as lab
from fusionring import horovodrun

MPICH = "mpich"  # Hydra process manager: MPICH, Intel MPI, MVAPICH
OPEN_MPI = "openmpi"  # ORTE (Open MPI <= 4) or PRRTE (Open MPI 5)
UNKNOWN = "unknown"

SLOWDOWN_ENV = "FUSIONRING_SLOWDOWN"
RANK_RECORDS_ENV = "FUSIONRING_RANK_RECORDS"
USAGE = ("usage: fusionrun -np N [--dry-run] [--cluster N --rate RATE] [--slow RANK:FACTOR]... "
         "[-H HOST:SLOTS,... | --hostfile FILE] [horovodrun options] "
         "[--mpiexec PATH] [mpiexec options...] [--] PROGRAM [ARGS...]")


# mpiexec options (Hydra's and Open MPI's) that take values, by name without leading dashes, with how
# many tokens follow. Needed so that a value ("-hosts a,b") is not taken for the program. Options given
# as --name=value need no entry; an option missing here is passed on with no value.
_MPIEXEC_VALUE_OPTIONS = {
    # Hydra
    "genv": 2, "env": 2, "genvlist": 1, "envlist": 1, "f": 1, "hostfile": 1, "machinefile": 1,
    "hosts": 1, "host": 1, "rankmap": 1, "wdir": 1, "configfile": 1, "launcher": 1, "launcher-exec": 1,
    "rmk": 1, "topolib": 1, "bind-to": 1, "map-by": 1, "membind": 1, "demux": 1, "errfile-pattern": 1,
    "outfile-pattern": 1, "gpus-per-proc": 1, "iface": 1, "localhost": 1, "nameserver": 1, "ppn": 1,
    "prepend-pattern": 1, "usize": 1, "bootstrap": 1, "bootstrap-exec": 1, "binding": 1,
    "memory-alloc-kinds": 1,
    # Open MPI (ORTE and PRRTE)
    "x": 1, "mca": 2, "gmca": 2, "prtemca": 2, "pmixmca": 2, "omca": 2, "N": 1, "npernode": 1,
    "npersocket": 1, "rank-by": 1, "output": 1, "output-filename": 1, "cpus-per-proc": 1,
    "cpus-per-rank": 1, "tune": 1, "am": 1, "preload-files": 1, "prefix": 1, "personality": 1,
    "path": 1, "stdin": 1, "timeout": 1, "report-bindings-file": 1, "rankfile": 1, "default-hostfile": 1,
}


class LaunchError(RuntimeError):
    """The command line cannot be launched as given; the message says what to change."""


@dataclasses.dataclass
class LaunchRequest:
    """What the user asked for, parsed from the command line."""

    num_ranks: Optional[int] = None
    program: List[str] = dataclasses.field(default_factory=list)
    mpiexec_options: List[str] = dataclasses.field(default_factory=list)
    dry_run: bool = False
    cluster_size: Optional[int] = None
    rate: Optional[str] = None
    slowdown: Dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> factor as typed
    mpiexec: Optional[str] = None
    hosts: Optional[str] = None          # HOST:SLOTS,... (-H, --hosts, or read from --hostfile)
    hostfile: Optional[str] = None       # as given, for an MPI that reads horovodrun's format itself
    rank_env: Dict[str, str] = dataclasses.field(default_factory=dict)  # FUSIONRING_* for every rank
    # horovodrun's on/off options as they end up (the last given wins): what each turns -> on
    toggles: Dict[str, bool] = dataclasses.field(default_factory=dict)
    launch_options: horovodrun.LaunchOptions = dataclasses.field(
        default_factory=horovodrun.LaunchOptions)  # horovodrun's nics, ssh, output files, ...
    notes: List[str] = dataclasses.field(default_factory=list)  # printed to stderr before the launch


@dataclasses.dataclass
class Launch:
    """The command to run: ``argv`` run with ``env_added`` on top of the launcher's environment."""

    argv: List[str]
    env_added: Dict[str, str]
    flavour: str
    files: Dict[str, str] = dataclasses.field(default_factory=dict)  # executables to write first
    dirs: List[str] = dataclasses.field(default_factory=list)  # directories to create first
    notes: List[str] = dataclasses.field(default_factory=list)

    def prepare(self, dirs: bool = True) -> None:
        """Create what the command refers to: an ssh wrapper, and output directories unless
        `dirs` is False (a dry run writes the wrapper so the printed command works as it is)."""
        try:
            for directory in self.dirs if dirs else []:
                os.makedirs(directory, exist_ok=True)
            for path, text in self.files.items():
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if not os.path.exists(path) or Path(path).read_text() != text:
                    Path(path).write_text(text)
                os.chmod(path, 0o755)
        except OSError as exc:
            raise LaunchError(f"could not create {exc.filename}: {exc.strerror}") from None

    def shell_command(self) -> str:
        """The launch as one shell line: ``NAME=value ... mpiexec ...``, every word quoted as needed."""
        assignments = [f"{name}={shlex.quote(value)}" for name, value in self.env_added.items()]
        return " ".join(assignments + [shlex.quote(word) for word in self.argv])


# ------------------------------------------------------------------------------------- the MPI found

def find_mpiexec(explicit: Optional[str] = None) -> str:
    """The ``mpiexec`` to use: ``explicit`` if given, else the one beside this Python, else on PATH.

    The one beside ``sys.executable`` comes first so a virtual environment's MPI (the one mpi4py was
    built against) wins over a system one. Raises ``LaunchError`` when there is none.
    """
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise LaunchError(f"--mpiexec {explicit}: not found or not executable")
        return found
    # not resolved: a venv's python is a symlink, and its bin/ is where its mpiexec lives
    beside_python = Path(sys.executable).parent
    for name in ("mpiexec", "mpirun"):
        candidate = beside_python / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise LaunchError(
        f"no mpiexec found beside {sys.executable} or on PATH; install an MPI "
        f"(e.g. `pip install mpich` in this environment, or the system's mpich/openmpi package)")


def flavour_from_version(text: str) -> str:
    """Name the MPI behind ``mpiexec --version`` output: ``mpich`` (Hydra), ``openmpi`` or ``unknown``."""
    lowered = text.lower()
    if "open mpi" in lowered or "openrte" in lowered or "prrte" in lowered or "prterun" in lowered:
        return OPEN_MPI
    if "hydra" in lowered or "mpich" in lowered or "intel(r) mpi" in lowered or "mvapich" in lowered:
        return MPICH
    return UNKNOWN


def detect_flavour(mpiexec: str) -> str:
    """Run ``mpiexec --version`` and name its flavour (see :func:`flavour_from_version`)."""
    try:
        done = subprocess.run([mpiexec, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"`{mpiexec} --version` failed: {exc}") from exc
    return flavour_from_version(done.stdout)


# ------------------------------------------------------------------------------------ command line

def _take_value(argv: Sequence[str], i: int, name: str, inline: Optional[str]) -> Tuple[str, int]:
    if inline is not None:
        return inline, i + 1
    if i + 1 >= len(argv):
        raise LaunchError(f"{name} needs a value")
    _check_value(argv[i + 1], name)
    return argv[i + 1], i + 2


_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _check_value(word: str, name: str) -> None:
    """Refuse an option where `name`'s value should be, as horovodrun's argparse does (a word
    with a space, or a negative number, is a value): otherwise `--timeline-filename --dry-run`
    would run the job and write its timeline to a file named ``--dry-run``."""
    if word.startswith("-") and word != "-" and " " not in word and not _NEGATIVE_NUMBER.match(word):
        raise LaunchError(f"{name} expected a value, got the option {word!r} "
                          f"(write {name}={word} for a value that starts with '-')")


def _positive_int(value: str, name: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise LaunchError(f"{name} needs a positive whole number, got {value!r}")
    return number


def parse_args(argv: Sequence[str]) -> LaunchRequest:
    """Split a ``fusionrun`` command line into its own options, mpiexec's options and the program.

    horovodrun's ``--config-file FILE`` is read first: its settings become options placed before
    the command line's, so that an option given on the command line wins, as in horovodrun.
    """
    request, config_file = _parse(argv)
    if config_file is None:
        return request
    path, start, end = config_file
    try:
        options, notes = horovodrun.config_file_options(path)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    request, _ = _parse(options + list(argv[:start]) + list(argv[end:]))
    request.notes[:0] = notes
    return request


def _parse(argv: Sequence[str]) -> Tuple[LaunchRequest, Optional[Tuple[str, int, int]]]:
    """parse_args without reading the configuration file: the request, and the file's path with
    where ``--config-file FILE`` stands in ``argv`` (start, end), if it does."""
    request = LaunchRequest()
    config_file: Optional[Tuple[str, int, int]] = None
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            request.program = list(argv[i + 1:])
            break
        if not token.startswith("-") or token == "-":
            request.program = list(argv[i:])
            break
        name, eq, value = token.partition("=")
        inline = value if eq else None
        name = _unabbreviated(name)
        if name in ("-np", "-n", "--np", "--num-proc"):
            raw, i = _take_value(argv, i, name, inline)
            request.num_ranks = _positive_int(raw, name)
        elif name == "--dry-run":
            request.dry_run, i = True, i + 1
        elif name == "--cluster":
            raw, i = _take_value(argv, i, name, inline)
            request.cluster_size = _positive_int(raw, name)
        elif name == "--rate":
            request.rate, i = _take_value(argv, i, name, inline)
        elif name == "--slow":
            raw, i = _take_value(argv, i, name, inline)
            rank, factor = _parse_slow(raw)
            if rank in request.slowdown:
                raise LaunchError(f"--slow given twice for rank {rank}")
            request.slowdown[rank] = factor
        elif name == "--mpiexec":
            request.mpiexec, i = _take_value(argv, i, name, inline)
        elif name in ("-H", "--hosts"):
            raw, i = _take_value(argv, i, name, inline)
            request.hosts = _parse_hosts(raw, name)
        elif name in ("--hostfile", "-hostfile"):
            request.hostfile, i = _take_value(argv, i, name, inline)
            request.hosts = _read_hostfile(request.hostfile)
        elif name in horovodrun.SETTINGS:
            raw, i = _take_value(argv, i, name, inline)
            variable, convert = horovodrun.SETTINGS[name]
            try:
                request.rank_env[variable] = convert(raw)
            except ValueError as exc:
                raise LaunchError(f"{name} {exc}") from None
        elif name in horovodrun.SWITCHES:
            request.rank_env.update(horovodrun.SWITCHES[name])
            i += 1
        elif name in horovodrun.TOGGLES:
            what, on = horovodrun.TOGGLES[name]
            request.toggles[what] = on
            i += 1
        elif name in horovodrun.LAUNCH_OPTIONS:
            raw = None
            if horovodrun.LAUNCH_OPTIONS[name]:
                raw, i = _take_value(argv, i, name, inline)
            else:
                i += 1
            try:
                request.launch_options.take(name, raw)
            except ValueError as exc:
                raise LaunchError(str(exc)) from None
        elif name in horovodrun.NO_EFFECT:
            arity, why = horovodrun.NO_EFFECT[name]
            i = _skip_values(argv, i, name, inline, arity)
            if why:
                request.notes.append(f"ignoring horovodrun's {name}: {why}")
        elif name in horovodrun.REFUSED:
            raise LaunchError(f"{name}: {horovodrun.REFUSED[name][1]}")
        elif name == "--config-file":
            if config_file is not None:
                raise LaunchError("--config-file given twice")
            start = i
            path, i = _take_value(argv, i, name, inline)
            config_file = (path, start, i)
        elif name in ("-cb", "--check-build"):
            print(horovodrun.check_build())
            raise SystemExit(0)
        elif name in ("-v", "--version"):
            from fusionring import __version__
            print(f"fusionrun (fusionring {__version__})")
            raise SystemExit(0)
        elif name in ("-h", "--help"):
            raise SystemExit(_print_help())
        else:
            _check_not_a_misspelling(name)
            arity = 0 if eq else _MPIEXEC_VALUE_OPTIONS.get(name.lstrip("-"), 0)
            if i + arity >= len(argv):
                raise LaunchError(f"mpiexec option {name} needs {arity} value(s)")
            request.mpiexec_options.extend(argv[i:i + 1 + arity])
            i += 1 + arity
    if config_file is None:
        _validate(request)
    return request, config_file


# The long options parsed here by name (the horovodrun tables add theirs).
_OWN_LONG_OPTIONS = ("--np", "--num-proc", "--dry-run", "--cluster", "--rate", "--slow",
                     "--mpiexec", "--hosts", "--hostfile", "--config-file", "--check-build",
                     "--version", "--help")


def _long_options() -> set:
    """Every long option fusionrun reads itself (its own and horovodrun's)."""
    known = set(_OWN_LONG_OPTIONS)
    for table in (horovodrun.SETTINGS, horovodrun.SWITCHES, horovodrun.TOGGLES,
                  horovodrun.LAUNCH_OPTIONS, horovodrun.NO_EFFECT, horovodrun.REFUSED):
        known.update(k for k in table if k.startswith("--"))
    return known


def _check_not_a_misspelling(name: str) -> None:
    """Refuse a long option that fusionrun would hand to mpiexec but that is a near miss of one
    of its own (``--fusion-threshold-mbb``): mpiexec would fail with only "unrecognized
    argument", or, worse, take it, and the setting would silently not apply."""
    if not name.startswith("--") or name.lstrip("-") in _MPIEXEC_VALUE_OPTIONS:
        return
    close = difflib.get_close_matches(name, sorted(_long_options()), n=3, cutoff=0.8)
    if close:
        raise LaunchError(
            f"unknown option {name}: did you mean {' or '.join(close)}? (fusionrun hands the "
            f"options it does not know to mpiexec; to mean mpiexec's, write it with one dash, "
            f"-{name.lstrip('-')})")


def _unabbreviated(name: str) -> str:
    """A long option as its full name when `name` begins exactly one of them, as argparse (and
    so horovodrun) takes ``--fusion-threshold`` for ``--fusion-threshold-mb``; a prefix of
    several is refused naming them; anything else is returned as it is (an mpiexec option)."""
    if not name.startswith("--"):
        return name
    known = _long_options()
    if name in known:
        return name
    matches = sorted(k for k in known if k.startswith(name))
    if len(matches) > 1:
        raise LaunchError(f"ambiguous option: {name} could match {', '.join(matches)}")
    return matches[0] if matches else name


def _skip_values(argv: Sequence[str], i: int, name: str, inline: Optional[str], arity: int) -> int:
    """The index after option `name` (at i) and its `arity` values."""
    if arity == 0 or inline is not None:
        return i + 1
    if i + arity >= len(argv):
        raise LaunchError(f"{name} needs {arity} value(s)")
    for word in argv[i + 1:i + 1 + arity]:
        _check_value(word, name)
    return i + 1 + arity


def _parse_hosts(raw: str, what: str) -> str:
    """Check a horovodrun host list (``a:4,b:4``; a host without slots gets one) and return it."""
    entries = [entry.strip() for entry in raw.split(",") if entry.strip()]
    if not entries:
        raise LaunchError(f"{what} needs HOST:SLOTS,... (e.g. -H localhost:4), got {raw!r}")
    for entry in entries:
        host, sep, slots = entry.partition(":")
        if not host or (sep and not (slots.isdigit() and int(slots) > 0)):
            raise LaunchError(f"{what}: {entry!r} is not HOST or HOST:SLOTS with SLOTS > 0")
    return ",".join(entries)


def _read_hostfile(path: str) -> str:
    """A hostfile's hosts as ``HOST:SLOTS,...``: lines ``HOST slots=N`` (horovodrun, Open MPI),
    ``HOST:N`` (MPICH) or ``HOST``; ``#`` starts a comment."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise LaunchError(f"--hostfile {path}: {exc.strerror or exc}") from None
    entries = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, slots = words[0], None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots":
                slots = value
        if slots is not None and not (slots.isdigit() and int(slots) > 0):
            raise LaunchError(f"--hostfile {path}, line {number}: slots must be a positive number, "
                              f"got {slots!r}")
        entries.append(host if slots is None else f"{host}:{slots}")
    if not entries:
        raise LaunchError(f"--hostfile {path} lists no hosts")
    return _parse_hosts(",".join(entries), f"--hostfile {path}")


def _parse_slow(raw: str) -> Tuple[int, str]:
    rank_text, sep, factor = raw.partition(":")
    try:
        rank, factor_value = int(rank_text), float(factor)
    except ValueError:
        rank, factor_value = -1, 0.0
    if not sep or rank < 0 or not factor_value > 0:
        raise LaunchError(f"--slow expects RANK:FACTOR with FACTOR > 0 (e.g. --slow 1:3), got {raw!r}")
    return rank, factor.strip()


def _validate(request: LaunchRequest) -> None:
    if request.cluster_size is not None:
        if request.num_ranks is None:
            request.num_ranks = request.cluster_size
        if request.cluster_size != request.num_ranks:
            raise LaunchError(f"--cluster {request.cluster_size} must equal -np {request.num_ranks}: "
                              f"the lab runs one rank per namespace")
        request.rate = request.rate or "1gbit"
        try:
            lab.parse_rate(request.rate)
        except ValueError as exc:
            raise LaunchError(f"--rate: {exc}") from exc
        if request.hosts is not None:
            raise LaunchError("--cluster places the ranks itself; drop -H/--hosts/--hostfile")
    elif request.rate is not None:
        raise LaunchError("--rate only applies with --cluster N")
    if request.num_ranks is None:
        raise LaunchError("-np N is required (the number of ranks)")
    for rank in request.slowdown:
        if rank >= request.num_ranks:
            raise LaunchError(f"--slow {rank}:...: rank {rank} does not exist with -np {request.num_ranks}")
    if not request.program:
        raise LaunchError("no program to run (e.g. `fusionrun -np 2 python train.py`)")


def _print_help() -> int:
    print(USAGE)
    print(__doc__)
    print("Own options:\n"
          "  -np N               number of ranks\n"
          "  --dry-run           print the command (with the environment it adds) and exit\n"
          "  --cluster N         run each rank in its own namespace of the emulated cluster (root);\n"
          "                      N must equal -np; the lab is built before and removed after\n"
          "  --rate RATE         the lab's link rate each way, as tc spells it (default 1gbit)\n"
          "  --slow RANK:FACTOR  make RANK compute FACTOR times slower (sets FUSIONRING_SLOWDOWN there)\n"
          "  --mpiexec PATH      use this mpiexec instead of the environment's\n"
          "horovodrun's options:\n"
          "  -H, --hosts HOST:SLOTS,...   the hosts and how many ranks each runs\n"
          "  --hostfile FILE              one host per line: HOST slots=N (or HOST:N)\n"
          "  --fusion-threshold-mb MB     FUSIONRING_FUSION_THRESHOLD (in bytes)\n"
          "  --cycle-time-ms MS           FUSIONRING_CYCLE_TIME_MS\n"
          "  --cache-capacity N                FUSIONRING_CACHE_CAPACITY\n"
          "  --timeline-filename PATH     FUSIONRING_TIMELINE (rank 0 creates missing directories)\n"
          "  --[no-]timeline-mark-cycles  FUSIONRING_TIMELINE_MARK_CYCLES=1/0 (off unless given)\n"
          "  --stall-check-warning-time-seconds S, --stall-check-shutdown-time-seconds S,\n"
          "  --[no-]stall-check           FUSIONRING_STALL_WARNING_S / FUSIONRING_STALL_SHUTDOWN_S\n"
          "                               (--no-stall-check outranks the times)\n"
          "  (values must be >= 0; a later option, and the command line over --config-file, wins)\n"
          "  --network-interface(s) NIC[,NIC]  the interfaces MPI (and NCCL/Gloo) may use\n"
          "  -p/--ssh-port PORT, -i/--ssh-identity-file FILE  how mpiexec reaches other hosts\n"
          "  --output-filename DIR        each rank's output in DIR/rank.N/stdout and stderr\n"
          "                               (Open MPI: its own --output-filename layout)\n"
          "  --mpi-args ARGS, --binding-args ARGS  more words for mpiexec\n"
          "  --tcp                        TCP between hosts, no fabrics\n"
          "  --prefix-output-with-timestamp  Open MPI's --timestamp-output (MPICH has none)\n"
          "  --verbose                    print the mpiexec command before running it\n"
          "  --config-file FILE           horovodrun's YAML settings (the command line wins)\n"
          "  -cb/--check-build, -v/--version   report and exit\n"
          "  --mpi and options for parts fusionring lacks (autotuning,\n"
          "  hierarchical allreduce, NCCL streams, log levels, ...) are accepted with a note;\n"
          "  --gloo, --jsrun and elastic options stop the launch with the reason.")
    return 0


# ------------------------------------------------------------------------------------ the command

def _forwardable(name: str) -> bool:
    """Whether an environment variable may be forwarded by name (shell functions and the
    previous directory are the shell's own)."""
    return name.isidentifier() and not name.startswith("BASH_FUNC_") and name != "OLDPWD"


def build_launch(request: LaunchRequest, mpiexec: str, flavour: str,
                 running_as_root: Optional[bool] = None,
                 environ: Optional[Dict[str, str]] = None) -> Launch:
    """Turn a request into the exact mpiexec command and the environment variables it adds.

    Ranks that need different argv (a namespace, a slowdown) are started as MPMD segments
    (``-n K prog : -n 1 env X=Y prog ...``); otherwise a plain ``-n N prog``. `environ` (default:
    this process's) is what Open MPI is told to forward to other hosts.
    """
    if running_as_root is None:
        running_as_root = os.geteuid() == 0
    environ = os.environ if environ is None else environ
    argv, env = [mpiexec], {}
    if flavour == OPEN_MPI:
        # Open MPI refuses more ranks than cores, and refuses root, unless told otherwise
        argv.append("--oversubscribe")
        if running_as_root:
            argv.append("--allow-run-as-root")
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if request.hosts is not None:
        if flavour == OPEN_MPI:
            # Open MPI reads horovodrun's hostfile format itself; -H takes HOST:SLOTS as is.
            argv += (["--hostfile", request.hostfile] if request.hostfile else ["-H", request.hosts])
        else:
            argv += ["-hosts", request.hosts]
    translation = horovodrun.translate(request.launch_options, flavour == OPEN_MPI,
                                       request.num_ranks)
    argv += translation.words
    rank_env = {**request.rank_env, **translation.env}
    rank_env.update(horovodrun.switch_env(request.toggles, request.rank_env, environ))
    env.update(rank_env)
    if flavour == OPEN_MPI:
        # Open MPI gives remote ranks only the variables it is told to; horovodrun tells it
        # the launching shell's whole environment, so HOROVOD_*/FUSIONRING_* settings, PATH
        # and PYTHONPATH reach every host. Ranks on this host inherit them anyway.
        forwarded = list(rank_env)
        if request.hosts is not None:
            forwarded += sorted(name for name in environ
                                if name not in rank_env and _forwardable(name))
        for name in forwarded:
            argv += ["-x", name]
    argv.extend(request.mpiexec_options)

    lab_layout = None
    if request.cluster_size is not None:
        if flavour == OPEN_MPI:
            raise LaunchError(
                "--cluster needs MPICH's mpiexec (Hydra); with Open MPI 5 the ranks start in their "
                "namespaces but its TCP transport does not connect peers on one host (PML add procs "
                "fails). Use an environment with `pip install mpich`, or --mpiexec PATH to one")
        lab_layout = lab.Cluster(request.cluster_size, request.rate or "1gbit")
        env.update(lab_layout.mpi_env())

    def rank_argv(rank: int) -> List[str]:
        words: List[str] = []
        if lab_layout is not None:
            words += lab_layout.rank_prefix(rank)
        if rank in request.slowdown:
            # `env` rather than a flavour's per-segment env option: one form for every MPI
            words += ["env", f"{SLOWDOWN_ENV}={request.slowdown[rank]}"]
        return words + list(request.program)

    segments: List[Tuple[int, List[str]]] = []
    for rank in range(request.num_ranks):
        words = rank_argv(rank)
        if segments and segments[-1][1] == words:
            segments[-1] = (segments[-1][0] + 1, words)
        else:
            segments.append((1, words))
    for index, (count, words) in enumerate(segments):
        if index:
            argv.append(":")
        argv += ["-n", str(count)] + words
    return Launch(argv, env, flavour, files=translation.files, dirs=translation.dirs,
                  notes=request.notes + translation.notes)


# ---------------------------------------------------------------------------------------- running

def _foreground_terminal() -> Optional[int]:
    """An fd on the controlling terminal when this process group owns it (an interactive run), else None."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _hand_terminal(fd: int, pgrp: int) -> None:
    # a background process group changing the foreground would be stopped by SIGTTOU
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgrp)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)


def run_launch(launch: Launch) -> int:
    """Run the launch in the foreground and return mpiexec's exit code (128+N if killed by signal N).

    mpiexec runs in its own process group, which gets the terminal: Ctrl-C reaches mpiexec and the
    ranks exactly as if mpiexec had been started by hand (Hydra treats a second Ctrl-C as "force
    abort", so the launcher must not add one). SIGINT, SIGTERM and SIGHUP sent to the launcher itself
    are passed on to mpiexec, once each.
    """
    env = dict(os.environ)
    env.update(launch.env_added)
    terminal = _foreground_terminal()

    def own_group() -> None:  # runs in the child, before exec; the parent hands the terminal too (no race)
        os.setpgid(0, 0)
        if terminal is not None:
            _hand_terminal(terminal, os.getpid())

    try:
        child = subprocess.Popen(launch.argv, env=env, preexec_fn=own_group)
    except OSError as exc:
        if terminal is not None:
            os.close(terminal)
        raise LaunchError(f"could not start {launch.argv[0]}: {exc}") from exc
    if terminal is not None:
        _hand_terminal(terminal, child.pid)
    running = True

    def forward(signum, _frame):
        if running:
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, forward) for signum in forwarded}
    try:
        while True:
            _, status = os.waitpid(child.pid, os.WUNTRACED)
            if not os.WIFSTOPPED(status):
                break
            # the job was suspended from the terminal (Ctrl-Z): suspend too, so the shell sees it,
            # and on `fg` hand the terminal back and resume the job
            if terminal is not None:
                _hand_terminal(terminal, os.getpgrp())
            os.kill(os.getpid(), signal.SIGSTOP)
            if terminal is not None:
                _hand_terminal(terminal, child.pid)
            os.killpg(child.pid, signal.SIGCONT)
        running = False
        child.returncode = os.waitstatus_to_exitcode(status)
    finally:
        running = False
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if terminal is not None:
            _hand_terminal(terminal, os.getpgrp())
            os.close(terminal)
    returncode = child.returncode
    return 128 - returncode if returncode < 0 else returncode


def rank_processes(folder: str) -> str:
    """'rank 0 = pid 123 on host, ...' from the notes ranks on this host left in `folder`
    (MPICH's launcher names a failed process by its id only), or '' when there are none."""
    found = []
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        if not entry.startswith("rank.") or not entry[5:].isdigit():
            continue
        try:
            pid, host = Path(folder, entry).read_text().split()[:2]
        except (OSError, ValueError):
            continue
        found.append((int(entry[5:]), pid, host))
    if not found:
        return ""
    return "its ranks' process ids: " + ", ".join(
        f"rank {rank} = pid {pid} on {host}" for rank, pid, host in sorted(found))


def _with_lab(request: LaunchRequest, body: Callable[[], int]) -> int:
    reason = lab.missing_prerequisites()
    if reason:
        raise LaunchError(f"--cluster: {reason}")
    cluster = lab.Cluster(request.cluster_size, request.rate or "1gbit")
    try:
        cluster.up(verify=True, out=sys.stderr)
        return body()
    finally:
        # a second Ctrl-C must not leave namespaces behind
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            cluster.down()
        finally:
            signal.signal(signal.SIGINT, previous)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``fusionrun`` entry point; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        request = parse_args(argv)
        mpiexec = find_mpiexec(request.mpiexec)
        flavour = detect_flavour(mpiexec)
        if flavour == UNKNOWN:
            print(f"fusionrun: could not tell which MPI {mpiexec} belongs to; adding no flavour-specific "
                  f"options", file=sys.stderr)
        launch = build_launch(request, mpiexec, flavour)
        for note in launch.notes:
            print(f"fusionrun: {note}", file=sys.stderr)
        if request.launch_options.verbose and not request.dry_run:
            print(f"fusionrun: {launch.shell_command()}", file=sys.stderr, flush=True)
        if request.dry_run:
            if request.cluster_size is not None:
                print(f"fusionrun: would build the lab first (python -m fusionring.cluster up "
                      f"{request.cluster_size} --rate {request.rate}) and remove it afterwards",
                      file=sys.stderr)
            launch.prepare(dirs=False)
            if launch.dirs:
                print(f"fusionrun: mpiexec writes to {os.path.dirname(launch.dirs[0])}/rank.N/, "
                      f"which a real run creates first", file=sys.stderr)
            print(launch.shell_command())
            return 0
        launch.prepare()
        records = tempfile.mkdtemp(prefix="fusionrun-ranks-")
        launch.env_added[RANK_RECORDS_ENV] = records
        try:
            if request.cluster_size is not None:
                code = _with_lab(request, lambda: run_launch(launch))
            else:
                code = run_launch(launch)
            if code not in (0, 130):  # 130: interrupted from the terminal, nothing to explain
                line = rank_processes(records)
                if line:
                    print(f"fusionrun: the job failed (exit code {code}); {line}", file=sys.stderr)
            return code
        finally:
            shutil.rmtree(records, ignore_errors=True)
    except LaunchError as exc:
        print(f"fusionrun: {exc}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    except lab.ClusterError as exc:
        print(f"fusionrun: emulated cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
