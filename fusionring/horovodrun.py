"""``horovodrun``'s command-line options, in ``fusionrun``'s terms.

A Horovod launch line works with only its first word changed. Each of horovodrun's options is one of:

- a fusionring setting (:data:`SETTINGS`): it becomes a ``FUSIONRING_*`` variable on every rank;
- a launch option (:data:`LAUNCH_OPTIONS`: hosts, network interfaces, ssh, output files, extra
  ``mpirun`` arguments): :func:`mpiexec_words` turns it into the found MPI's own options;
- an option for a part of Horovod that fusionring does not have (:data:`NO_EFFECT`: autotuning,
  hierarchical allreduce, NCCL streams, ...): accepted, with one line on stderr saying why it
  changes nothing, so the job still runs;
- an option whose meaning cannot be kept (:data:`REFUSED`: elastic launches, Gloo, jsrun): the
  launch stops with the reason before anything starts.

``--config-file FILE`` reads horovodrun's YAML configuration: :func:`config_file_options` turns
its settings into the options above, which options on the command line then override.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import shlex
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple


def _number(raw: str, whole: bool = False) -> float:
    """`raw` as a number >= 0; the ValueError says what is wrong, for the option's name to precede."""
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        raise ValueError(f"needs a {'whole ' if whole else ''}number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"needs a number, got {raw!r}")
    if value < 0:  # horovodrun refuses these at launch too
        raise ValueError(f"must be >= 0, got {raw!r}")
    return value


def _mib_to_bytes(raw: str) -> str:
    return str(int(_number(raw) * 1024 * 1024))


def _as_float(raw: str) -> str:
    return str(_number(raw))


def _as_count(raw: str) -> str:
    return str(int(_number(raw, whole=True)))


# option -> (the FUSIONRING_* variable set on every rank, how the value is checked and converted:
# a ValueError says what is wrong with it). Horovod takes the fusion threshold in MiB;
# fusionring's variable is in bytes.
SETTINGS: Dict[str, Tuple[str, Callable[[str], str]]] = {
    "--fusion-threshold-mb": ("FUSIONRING_FUSION_THRESHOLD", _mib_to_bytes),
    "--cycle-time-ms": ("FUSIONRING_CYCLE_TIME_MS", _as_float),
    "--timeline-filename": ("FUSIONRING_TIMELINE", str),
    "--stall-check-warning-time-seconds": ("FUSIONRING_STALL_WARNING_S", _as_float),
    "--stall-check-shutdown-time-seconds": ("FUSIONRING_STALL_SHUTDOWN_S", _as_float),
    "--cache-capacity": ("FUSIONRING_CACHE_CAPACITY", _as_count),
}

# Switches that set fusionring variables as they stand (a later option may set them again, so
# the command line overrides the config file).
SWITCHES: Dict[str, Dict[str, str]] = {
    "--timeline-mark-cycles": {"FUSIONRING_TIMELINE_MARK_CYCLES": "1"},
    "--no-timeline-mark-cycles": {"FUSIONRING_TIMELINE_MARK_CYCLES": "0"},
}

# horovodrun's on/off pairs whose effect depends on other options: option -> (what it turns,
# on or off). The last one given wins; switch_env says what they set on every rank.
TOGGLES: Dict[str, Tuple[str, bool]] = {
    "--stall-check": ("stall_check", True),
    "--no-stall-check": ("stall_check", False),
}
_MARK_CYCLES_VARIABLES = ("FUSIONRING_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES")


def switch_env(toggles: Dict[str, bool], rank_env: Dict[str, str],
               environ: Mapping[str, str]) -> Dict[str, str]:
    """What horovodrun would set on every rank beyond `rank_env` (the variables the options
    set), given its on/off options (`toggles`: what each turns, as TOGGLES names it) and the
    launching shell's environment (`environ`)."""
    env: Dict[str, str] = {}
    stall_check = toggles.get("stall_check")
    if stall_check is False:
        # Off outranks any stall time, given before or after it, as in horovodrun.
        env.update(FUSIONRING_STALL_WARNING_S="0", FUSIONRING_STALL_SHUTDOWN_S="0")
    elif stall_check and environ.get("HOROVOD_STALL_CHECK_DISABLE", "").strip():
        env["HOROVOD_STALL_CHECK_DISABLE"] = "0"  # horovodrun sets it over the shell's
    if (rank_env.get("FUSIONRING_TIMELINE") and "FUSIONRING_TIMELINE_MARK_CYCLES" not in rank_env
            and not any(environ.get(name, "").strip() for name in _MARK_CYCLES_VARIABLES)):
        env["FUSIONRING_TIMELINE_MARK_CYCLES"] = "0"  # horovodrun marks no cycles unless told to
    return env


# Launch options handled by LaunchOptions (name -> how many values follow).
LAUNCH_OPTIONS: Dict[str, int] = {
    "--network-interface": 1, "--network-interfaces": 1, "--nics": 1,
    "-p": 1, "--ssh-port": 1, "-i": 1, "--ssh-identity-file": 1,
    "--output-filename": 1, "--mpi-args": 1, "--binding-args": 1, "--tcp": 0,
    "-prefix-timestamp": 0, "--prefix-output-with-timestamp": 0, "--verbose": 0,
}

_AUTOTUNE = ("fusionring has no autotuner: --fusion-threshold-mb and --cycle-time-ms set the values, "
             "and a grouping plan (docs/plan.md) balances the buffers")
_HIERARCHICAL = "fusionring's ring spans all ranks; it has no hierarchical mode"
# Options for parts of horovodrun or Horovod that fusionring does not have: name -> (values that
# follow, why it changes nothing; "" when it asks for what fusionring does anyway, said nothing of).
NO_EFFECT: Dict[str, Tuple[int, str]] = {
    "--mpi": (0, ""),
    "--start-timeout": (1, "fusionrun makes no checks of its own before mpiexec starts the ranks"),
    # horovodrun's flag stops it caching its own start-up checks; the response cache stays on
    "--disable-cache": (0, ""),
    "--hierarchical-allreduce": (0, _HIERARCHICAL),
    "--no-hierarchical-allreduce": (0, ""),
    "--hierarchical-allgather": (0, _HIERARCHICAL),
    "--no-hierarchical-allgather": (0, ""),
    "--torus-allreduce": (0, _HIERARCHICAL + " (nor its torus form over NCCL)"),
    "--no-torus-allreduce": (0, ""),
    "--autotune": (0, _AUTOTUNE),
    "--no-autotune": (0, ""),
    "--autotune-log-file": (1, _AUTOTUNE),
    "--autotune-warmup-samples": (1, _AUTOTUNE),
    "--autotune-steps-per-sample": (1, _AUTOTUNE),
    "--autotune-bayes-opt-max-samples": (1, _AUTOTUNE),
    "--autotune-gaussian-process-noise": (1, _AUTOTUNE),
    "--num-nccl-streams": (1, "fusionring's NCCL transport runs one CUDA stream per process set"),
    "--thread-affinity": (1, "fusionring does not pin its background thread to a core"),
    "--gloo-timeout-seconds": (1, "fusionring does not run over Gloo"),
    "--mpi-threads-disable": (0, "fusionring's background thread calls MPI while the training "
                                 "thread may too, so it needs MPI_THREAD_MULTIPLE"),
    "--no-mpi-threads-disable": (0, ""),
    "--log-level": (1, "fusionring has no log levels: its warnings and errors always go to stderr"),
    "--log-with-timestamp": (0, "fusionring's messages carry no timestamps"),
    "--log-without-timestamp": (0, ""),
    "--log-hide-timestamp": (0, ""),
    "--no-log-hide-timestamp": (0, "fusionring's messages carry no timestamps"),
}

_ELASTIC = ("elastic launches are not supported: fusionrun starts a fixed set of MPI ranks "
            "(hvd.elastic.run still restores the last committed state after an error); "
            "drop the elastic options and give -np")
# Options whose meaning fusionrun cannot keep: name -> (values that follow, the reason).
REFUSED: Dict[str, Tuple[int, str]] = {
    "--gloo": (0, "fusionring's ranks are MPI processes started by mpiexec; drop --gloo"),
    "--jsrun": (0, "fusionrun starts the ranks with mpiexec; drop --jsrun, or start the script "
                   "with jsrun yourself (every rank is an MPI process)"),
    "--min-np": (1, _ELASTIC), "--min-num-proc": (1, _ELASTIC),
    "--max-np": (1, _ELASTIC), "--max-num-proc": (1, _ELASTIC),
    "--slots-per-host": (1, _ELASTIC), "--elastic-timeout": (1, _ELASTIC),
    "--reset-limit": (1, _ELASTIC), "--blacklist-cooldown-range": (2, _ELASTIC),
    "--host-discovery-script": (1, _ELASTIC),
}


# horovodrun's configuration file: section -> key -> the option it stands for. A value option takes
# the key's value; a switch option maps true and false to the switch for each (None: no switch).
_CONFIG_VALUES: Dict[str, Dict[str, str]] = {
    "params": {"fusion_threshold_mb": "--fusion-threshold-mb", "cycle_time_ms": "--cycle-time-ms",
               "cache_capacity": "--cache-capacity"},
    "timeline": {"filename": "--timeline-filename"},
    "stall_check": {"warning_time_seconds": "--stall-check-warning-time-seconds",
                    "shutdown_time_seconds": "--stall-check-shutdown-time-seconds"},
    "library_options": {"num_nccl_streams": "--num-nccl-streams",
                        "ccl_bgt_affinity": "--thread-affinity",
                        "gloo_timeout_seconds": "--gloo-timeout-seconds"},
    "logging": {"level": "--log-level"},
}
_CONFIG_SWITCHES: Dict[str, Dict[str, Tuple[Optional[str], Optional[str]]]] = {
    "params": {"hierarchical_allreduce": ("--hierarchical-allreduce", None),
               "hierarchical_allgather": ("--hierarchical-allgather", None),
               "torus_allreduce": ("--torus-allreduce", None)},
    "autotune": {"enabled": ("--autotune", None)},
    "timeline": {"mark_cycles": ("--timeline-mark-cycles", "--no-timeline-mark-cycles")},
    "stall_check": {"enabled": ("--stall-check", "--no-stall-check")},
    "library_options": {"mpi_threads_disable": ("--mpi-threads-disable", None)},
    "logging": {"with_timestamp": ("--log-with-timestamp", None), "hide_timestamp": (None, None)},
}
# Settings whose value is text; the others are numbers.
_CONFIG_TEXT_KEYS = ("filename", "level")
# Autotuning's own settings: they matter only when it is enabled, and then its note covers them.
_CONFIG_AUTOTUNE_KEYS = ("log_file", "warmup_samples", "steps_per_sample", "bayes_opt_max_samples",
                         "gaussian_process_noise")


def config_file_options(path: str) -> Tuple[List[str], List[str]]:
    """horovodrun's YAML configuration file as (options, notes).

    The options are horovodrun's own (``--cycle-time-ms 10``, ``--no-stall-check``, ...), to be
    read before the command line's so that the command line overrides the file, as in horovodrun.
    Keys horovodrun does not know are left out with a note. Raises ValueError naming the file and
    the key for a file that cannot be read or a value of the wrong kind.
    """
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise ValueError("--config-file needs PyYAML: pip install pyyaml") from None
    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--config-file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config-file {path} is not valid YAML: {exc}") from None
    if config is None:
        return [], []
    if not isinstance(config, dict):
        raise ValueError(f"--config-file {path}: expected sections (params:, timeline:, ...) at the "
                         f"top, got {type(config).__name__}")
    options: List[str] = []
    notes: List[str] = []
    for section, body in config.items():
        where = f"--config-file {path}: {section}"
        if section == "controller":
            if str(body).lower() == "gloo":
                raise ValueError(f"{where}: gloo: fusionring's ranks are MPI processes started by "
                                 f"mpiexec; set controller: mpi")
            if str(body).lower() != "mpi":
                raise ValueError(f"{where}: expected mpi or gloo, got {body!r}")
            continue
        values, switches = _CONFIG_VALUES.get(section), _CONFIG_SWITCHES.get(section)
        if values is None and switches is None:
            notes.append(f"ignoring {section} in {path}: horovodrun has no such section")
            continue
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ValueError(f"{where}: expected keys under it, got {body!r}")
        stall_check_off = section == "stall_check" and body.get("enabled") is False
        for key, value in body.items():
            if value is None or (stall_check_off and key != "enabled"):
                continue  # a disabled stall check has no times, as in horovodrun
            if values and key in values:
                if key in _CONFIG_TEXT_KEYS:
                    if not isinstance(value, str):
                        raise ValueError(f"{where}.{key}: expected text, got {value!r}")
                elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(f"{where}.{key}: expected a number >= 0, got {value!r}")
                given = [values[key], str(value)]
            elif switches and key in switches:
                if not isinstance(value, bool):
                    raise ValueError(f"{where}.{key}: expected true or false, got {value!r}")
                switch = switches[key][0 if value else 1]
                given = [switch] if switch else []
            elif section == "autotune" and key in _CONFIG_AUTOTUNE_KEYS:
                continue
            else:
                notes.append(f"ignoring {section}.{key} in {path}: horovodrun has no such setting")
                continue
            if given and given[0] in NO_EFFECT:  # said here, in the file's words
                why = NO_EFFECT[given[0]][1]
                if why:
                    notes.append(f"ignoring {section}.{key} in {path}: {why}")
            else:
                options += given
    return options, notes


@dataclasses.dataclass
class LaunchOptions:
    """horovodrun's launch options as given, before they are put in one MPI's words."""

    nics: List[str] = dataclasses.field(default_factory=list)
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    output_dir: Optional[str] = None
    extra_mpi_args: List[str] = dataclasses.field(default_factory=list)  # --mpi-args, --binding-args
    tcp: bool = False
    prefix_timestamp: bool = False
    verbose: bool = False

    def take(self, name: str, value: Optional[str]) -> None:
        """Record one option (`value` is None for a switch). Raises ValueError naming it."""
        if name in ("--network-interface", "--network-interfaces", "--nics"):
            nics = [nic.strip() for nic in value.split(",") if nic.strip()]
            if not nics:
                raise ValueError(f"{name} needs a network interface name (e.g. eth0)")
            self.nics += [nic for nic in nics if nic not in self.nics]
        elif name in ("-p", "--ssh-port"):
            if not (value.isdigit() and 0 < int(value) < 65536):
                raise ValueError(f"{name} needs a port number, got {value!r}")
            self.ssh_port = int(value)
        elif name in ("-i", "--ssh-identity-file"):
            self.ssh_identity_file = value
        elif name == "--output-filename":
            self.output_dir = value
        elif name in ("--mpi-args", "--binding-args"):
            try:
                self.extra_mpi_args += shlex.split(value)
            except ValueError as exc:
                raise ValueError(f"{name} {value!r}: {exc}") from None
        elif name == "--tcp":
            self.tcp = True
        elif name in ("-prefix-timestamp", "--prefix-output-with-timestamp"):
            self.prefix_timestamp = True
        elif name == "--verbose":
            self.verbose = True
        else:
            raise KeyError(name)


@dataclasses.dataclass
class Translation:
    """What the launch options become for one MPI: mpiexec words, variables for every rank, files
    and directories to create before mpiexec starts, and notes for the user."""

    words: List[str] = dataclasses.field(default_factory=list)
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    files: Dict[str, str] = dataclasses.field(default_factory=dict)  # path -> executable script
    dirs: List[str] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)


def ssh_wrapper_path(ssh_args: List[str]) -> str:
    """Where the ssh wrapper for these arguments lives: one per distinct set, reused across runs,
    so a printed (dry-run) command stays valid."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusionring"
    digest = hashlib.sha256("\0".join(ssh_args).encode()).hexdigest()[:12]
    return str(cache / f"ssh-{digest}")


def translate(options: LaunchOptions, open_mpi: bool, num_ranks: int) -> Translation:
    """Put the launch options in the words of Open MPI's mpiexec, or else Hydra's (MPICH)."""
    out = Translation()
    ssh_args: List[str] = []
    if options.ssh_port is not None:
        ssh_args += ["-p", str(options.ssh_port)]
    if options.ssh_identity_file:
        ssh_args += ["-i", options.ssh_identity_file]
    if open_mpi:
        if ssh_args:
            out.words += ["--mca", "plm_rsh_args", " ".join(shlex.quote(a) for a in ssh_args)]
        if options.nics:
            nics = ",".join(options.nics)
            # MPI's data only: Open MPI's launcher finds its own way, and refuses loopback there
            out.words += ["--mca", "btl_tcp_if_include", nics]
        if options.tcp:  # ob1 with its byte transfer layers (TCP, shared memory, self), no fabrics
            out.words += ["--mca", "pml", "ob1", "--mca", "btl", "^openib,uct,ofi"]
        if options.output_dir:
            out.words += ["--output-filename", options.output_dir]
        if options.prefix_timestamp:
            out.words += ["--timestamp-output"]
    else:
        if ssh_args:
            # Hydra's -launcher-exec names one executable and takes no arguments of its own.
            wrapper = ssh_wrapper_path(ssh_args)
            out.files[wrapper] = ("#!/bin/sh\nexec ssh " + " ".join(shlex.quote(a) for a in ssh_args)
                                  + ' "$@"\n')
            out.words += ["-launcher", "ssh", "-launcher-exec", wrapper]
        if options.nics:
            # Hydra's own connections and the TCP transports of MPICH's libfabric and UCX builds
            out.words += ["-iface", options.nics[0]]
            out.env["FI_TCP_IFACE"] = options.nics[0]
            out.env["UCX_NET_DEVICES"] = ",".join(options.nics)
        if options.tcp:
            out.env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")
        if options.output_dir:
            # Hydra writes to the pattern's files but creates no directories.
            out.dirs += [os.path.join(options.output_dir, f"rank.{r}") for r in range(num_ranks)]
            pattern = os.path.join(options.output_dir, "rank.%r")
            out.words += ["-outfile-pattern", os.path.join(pattern, "stdout"),
                          "-errfile-pattern", os.path.join(pattern, "stderr")]
        if options.prefix_timestamp:
            out.notes.append("ignoring horovodrun's --prefix-output-with-timestamp: MPICH's "
                             "mpiexec cannot timestamp output (its -prepend-rank labels it by rank)")
    if options.nics:  # torch.distributed, NCCL and Gloo, should the script use them too
        out.env["NCCL_SOCKET_IFNAME"] = ",".join(options.nics)
        out.env["GLOO_SOCKET_IFNAME"] = options.nics[0]
    out.words += options.extra_mpi_args
    return out


def check_build() -> str:
    """horovodrun --check-build's report, for this installation."""
    import importlib.util

    from fusionring import __version__

    try:
        from fusionring import _C
        core, cuda = True, bool(getattr(_C, "nm_cuda_built", False))
    except ImportError:
        core = cuda = False

    # CUDA tensors are reduced over NCCL where CuPy's binding loads (pip install "fusionring[gpu]").
    nccl = importlib.util.find_spec("cupy") is not None and _nccl_loads()

    def box(flag: bool) -> str:
        return "[X]" if flag else "[ ]"

    torch_found = importlib.util.find_spec("torch") is not None
    lines = [f"fusionring v{__version__}:", "",
             "Available Frameworks:",
             f"    {box(False)} TensorFlow", f"    {box(torch_found)} PyTorch", f"    {box(False)} MXNet",
             "", "Available Controllers:", f"    {box(core)} MPI", f"    {box(False)} Gloo",
             "", "Available Tensor Operations:", f"    {box(nccl)} NCCL", f"    {box(False)} DDL",
             f"    {box(False)} CCL", f"    {box(core)} MPI", f"    {box(False)} Gloo",
             f"    {box(cuda)} CUDA kernels (N:M)"]
    if not core:
        lines += ["", "fusionring._C is not built: reinstall with `pip install .`"]
    return "\n".join(lines)


def _nccl_loads() -> bool:
    try:
        from .runtime.nccl import nccl_version
    except ImportError:  # the core is not built
        return False
    return nccl_version() > 0
