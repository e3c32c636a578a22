"""``fusionring bench``: fusionring against the peers a user would pick instead, in one run.

One command trains the same model on the same data, ranks and link with every *contender* in turn —
fusionring (dense, fp16, and any compressor registered below), PyTorch DDP over gloo (dense, with
``fp16_compress_hook``, with ``powerSGD_hook``) and MPI's own allreduce — interleaved in one job, and
optionally times raw 64 MiB allreduces of the fusionring core, MPI and gloo. It prints the tables and,
with ``--name``, writes ``docs/benchmarks/<name>.md`` with plots and the command that made it::

    fusionring bench -np 4                                       # localhost, print the tables
    python scripts/bench.py -np 4 --cluster --rates 1gbit,10gbit --name cluster-1gbit
    python scripts/bench.py --list                               # the contenders

A contender is a name in :data:`CONTENDERS` whose setup function returns an object with
``step(batch)`` and ``bytes_sent()`` (see :class:`Contender`); :func:`register_contender` adds one.
See ``docs/bench.md``.

The package: ``contenders`` (the registry and the contenders), ``probes`` (what runs on every
rank), ``driver`` (launching and summing up), ``report`` (tables, plots, the page), ``cli``,
and ``util``, the building blocks the scripts in ``scripts/`` share with it.
"""
from __future__ import annotations

from .util import (DEFAULT_DOC_DIR, MIB, REPO_ROOT, ring_bytes)
from .contenders import (BenchContext, CONTENDERS, Contender, ContenderSpec, DdpContender,
                         FusionringContender, MpiAllreduceContender, available_contenders,
                         build_model, default_contenders, register_contender)
from .probes import (init_gloo, interface_address, run_collectives, run_training, run_worker)
from .driver import (LinkRun, summarize_collectives, summarize_training, time_to_accuracy)
from .report import (FINDINGS_END, FINDINGS_START, collectives_table, kept_findings, plot_runs,
                     print_summary, render_markdown, training_table)
from .cli import (configure_parser, load_runs, main, run_command, run_driver)

__all__ = ["BenchContext", "CONTENDERS", "Contender", "ContenderSpec", "DEFAULT_DOC_DIR",
           "DdpContender", "FINDINGS_END", "FINDINGS_START", "FusionringContender", "LinkRun",
           "MIB", "MpiAllreduceContender", "REPO_ROOT", "available_contenders", "build_model",
           "collectives_table", "configure_parser", "default_contenders", "init_gloo", "interface_address",
           "kept_findings", "load_runs", "main", "plot_runs", "print_summary",
           "register_contender", "render_markdown", "ring_bytes", "run_collectives", "run_command",
           "run_driver", "run_training", "run_worker", "summarize_collectives",
           "summarize_training", "time_to_accuracy", "training_table"]
