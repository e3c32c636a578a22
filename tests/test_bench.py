"""The peer-comparison harness (fusionring.bench): contenders, byte counts, the written page."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT, mpiexec_path
from fusionring import bench


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """One quick localhost run of every available contender at 2 ranks, tiny model, 2 steps a turn."""
    mpiexec_path()  # skips without MPI
    out = tmp_path_factory.mktemp("bench")
    saved = out / "runs.json"
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"), "-np", "2", "--mode", "train",
               "--steps", "2", "--repeats", "2", "--warmup", "1", "--hidden", "32", "--depth", "1",
               "--json", str(saved), "--name", "tiny", "--doc-dir", str(out), "--timeout-s", "100"]
    done = subprocess.run(command, cwd=str(out), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(saved.read_text())["runs"][0]["result"], out


def test_every_contender_trains_with_a_finite_step_time_and_sends_bytes(two_rank_run):
    result, _ = two_rank_run
    contenders = result["training"]["contenders"]
    assert result["training"]["skipped"] == {}
    assert set(contenders) == set(bench.default_contenders())
    for name, data in contenders.items():
        assert len(data["turns"]) == 2, name
        for turn in data["turns"]:
            assert math.isfinite(turn["step_seconds"]) and turn["step_seconds"] > 0, name
            assert turn["bytes_per_step"] > 0, name
        assert data["history"][-1]["step"] == 1 + 2 * 2, name


def test_dense_fusionring_sends_the_ring_volume_of_the_gradients(two_rank_run):
    result, _ = two_rank_run
    gradient_bytes = result["model"]["gradient_bytes"]
    expected = bench.ring_bytes(gradient_bytes, result["ranks"])
    for turn in result["training"]["contenders"]["fusionring"]["turns"]:
        assert turn["bytes_per_step"] == pytest.approx(expected, rel=0.03)


def test_dense_peers_send_what_dense_fusionring_sends_and_fp16_half(two_rank_run):
    result, _ = two_rank_run
    contenders = result["training"]["contenders"]
    dense = contenders["fusionring"]["turns"][0]["bytes_per_step"]
    for name in ("ddp", "mpi"):
        assert contenders[name]["turns"][0]["bytes_per_step"] == pytest.approx(dense, rel=0.03)
    for name in ("ddp-fp16", "fusionring-fp16"):
        assert contenders[name]["turns"][0]["bytes_per_step"] == pytest.approx(dense / 2, rel=0.03)


def test_ddp_layer_selection_sends_less_than_dense_ddp(two_rank_run):
    result, _ = two_rank_run
    contenders = result["training"]["contenders"]
    dense = contenders["ddp"]["turns"][0]["bytes_per_step"]
    for turn in contenders["ddp-layers"]["turns"]:   # one of the two layers, and the scores
        assert 0 < turn["bytes_per_step"] < 0.9 * dense


def test_same_math_gives_the_same_accuracy_for_dense_contenders(two_rank_run):
    result, _ = two_rank_run
    contenders = result["training"]["contenders"]
    curves = {name: [round(p["accuracy"], 4) for p in contenders[name]["history"]]
              for name in ("fusionring", "ddp", "mpi")}
    assert curves["fusionring"] == curves["ddp"] == curves["mpi"]


def test_the_page_has_the_command_tables_and_plots(two_rank_run):
    _, out = two_rank_run
    page = (out / "tiny.md").read_text()
    assert "scripts/bench.py -np 2" in page
    for name in bench.default_contenders():
        assert f"| `{name}` |" in page
    for image in ("tiny-step-time.png", "tiny-accuracy.png"):
        assert (out / image).stat().st_size > 0 and f"]({image})" in page


def test_a_new_contender_plugs_in_by_name():
    @bench.register_contender("test-null", "does nothing", missing=lambda: "only a test", default=False)
    def _null(ctx):
        raise AssertionError("never set up")

    try:
        assert "test-null" in bench.CONTENDERS
        assert "test-null" not in bench.available_contenders()
        with pytest.raises(ValueError):
            bench.register_contender("test-null", "again")(_null)
    finally:
        del bench.CONTENDERS["test-null"]


def test_time_to_accuracy_is_the_first_evaluation_at_the_target():
    history = [{"step": 3, "seconds": 1.0, "accuracy": 0.5}, {"step": 7, "seconds": 2.5, "accuracy": 0.91},
               {"step": 11, "seconds": 4.0, "accuracy": 0.95}]
    assert bench.time_to_accuracy(history, 0.9) == {"steps": 7, "seconds": 2.5}
    assert bench.time_to_accuracy(history, 0.99) is None


def test_nm_contender_is_listed_when_the_build_has_it():
    import fusionring.torch as hvd

    assert ("fusionring-nm24" in bench.available_contenders()) == hasattr(hvd.Compression, "nm")


def test_a_contender_from_another_module_is_listed_with_import(tmp_path):
    (tmp_path / "extra_contenders.py").write_text(
        "from fusionring.bench import MpiAllreduceContender, register_contender\n"
        "register_contender('mpi-again', 'the MPI contender once more')(MpiAllreduceContender)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--import", "extra_contenders",
                           "--list"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert any(line.startswith("mpi-again ") for line in done.stdout.splitlines())


def test_the_adasum_benchmark_times_every_dtype_and_writes_its_page(tmp_path):
    mpiexec_path()  # skips without MPI
    doc = tmp_path / "adasum.md"
    command = [sys.executable, str(ROOT / "scripts" / "bench_adasum.py"), "--ranks", "2",
               "--elements", "1000", "--repeats", "1", "--doc", str(doc), "--timeout-s", "100"]
    done = subprocess.run(command, cwd=str(tmp_path), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    page = doc.read_text()
    for row in ("Adasum float32", "Adasum float16", "Adasum bfloat16", "Sum float16", "MPI float32"):
        assert f"| {row} |" in page
    assert "python scripts/bench_adasum.py --ranks 2" in page and (tmp_path / "adasum.png").exists()


def test_the_many_tensors_benchmark_times_every_contender_and_writes_its_page(tmp_path):
    mpiexec_path()  # skips without MPI
    doc = tmp_path / "many.md"
    command = [sys.executable, str(ROOT / "scripts" / "bench_many_tensors.py"), "-np", "2",
               "--tensors", "30", "--numel", "8", "--steps", "6", "--rounds", "1",
               "--tree", f"here={ROOT}", "--output", str(doc)]
    done = subprocess.run(command, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    page = doc.read_text()
    for row in ("fusionring (here)", "ddp", "none (1 rank, no communication)"):
        assert f"| {row} |" in page, page
    assert "| ddp | " in page and "| 1.00 |" in page
    assert "python scripts/bench_many_tensors.py -np 2" in page and (tmp_path / "many.png").exists()


def test_benchmark_pages_share_one_table_and_one_kept_section_helper(tmp_path):
    """fusionring bench's page and the scripts' pages go through the same helpers."""
    from fusionring.bench import util

    assert util.markdown_table(["a", "b"], [[1, 2]], align="--") == "| a | b |\n| --- | --- |\n| 1 | 2 |"
    assert util.markdown_table(["a", "b"], [[1, 2]]) == "| a | b |\n|:---|---:|\n| 1 | 2 |"
    page = tmp_path / "page.md"
    page.write_text(f"# t\n\n## Findings\nkept by hand\n\n## Table\nx\n\n"
                    f"{bench.FINDINGS_START}\nnotes\n{bench.FINDINGS_END}\nrest\n")
    assert util.preserved_section(str(page), "Findings") == "kept by hand"
    assert bench.kept_findings(page) == f"{bench.FINDINGS_START}\nnotes\n{bench.FINDINGS_END}"
    assert util.preserved_section(str(tmp_path / "absent.md"), "Findings") is None


def test_one_format_bytes_serves_benchmarks_and_plans():
    from fusionring import plan, units
    from fusionring.bench import util

    assert util.format_bytes is units.format_bytes
    assert [units.format_bytes(n) for n in (100, 4096, 1.25 * 2 ** 20)] == ["100 B", "4 KiB",
                                                                          "1.25 MiB"]
    assert plan.format_bytes(1536) == "1.50 KiB" and plan.format_bytes(3 << 30) == "3.00 GiB"


def test_cluster_contender_is_listed_when_the_build_has_it():
    import fusionring.torch as hvd

    assert (("fusionring-cluster" in bench.available_contenders())
            == hasattr(hvd.Compression, "cluster"))


def _step_phases_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_step_phases",
                                                  ROOT / "scripts" / "bench_step_phases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_phases_put_the_ranks_on_one_time_line():
    """Phases come from the earliest start, the latest ready and reduced stamps and the latest
    end across ranks; the link time from the ring's bytes at the payload share of the rate."""
    phases = _step_phases_module()
    ms = 1e-3
    # two ranks, three steps; the first is left out (warm-up)
    rank0 = [dict(start=0, big=50 * ms, reduced=90 * ms, end=95 * ms),
             dict(start=1.0, big=1.0 + 10 * ms, reduced=1.0 + 400 * ms, end=1.0 + 410 * ms),
             dict(start=2.0, big=2.0 + 20 * ms, reduced=2.0 + 300 * ms, end=2.0 + 306 * ms)]
    rank1 = [dict(start=0, big=60 * ms, reduced=99 * ms, end=99 * ms),
             dict(start=1.0 + 5 * ms, big=1.0 + 30 * ms, reduced=1.0 + 401 * ms, end=1.0 + 420 * ms),
             dict(start=2.0 - 4 * ms, big=2.0 + 40 * ms, reduced=2.0 + 302 * ms, end=2.0 + 303 * ms)]
    out = phases.summarize({"rows": [rank0, rank1], "ring_bytes": 119.5e6 / 8}, 1e9, warmup=1)
    # step 1: start 1.000, ready 1.030, reduced 1.401, end 1.420
    # step 2: start 1.996, ready 2.040, reduced 2.302, end 2.306
    assert out["step"] == pytest.approx((420 + 310) / 2)
    assert out["first_big_ready"] == pytest.approx((30 + 44) / 2)
    assert out["comm_after"] == pytest.approx((371 + 262) / 2)
    assert out["opt"] == pytest.approx((19 + 4) / 2)
    assert out["link"] == pytest.approx(119.5e6 / (1e9 * 0.956) * 1e3)


def test_gpu_report_states_each_kernel_against_the_copy_and_its_target():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    mib = 1 << 20
    results = {"device": "a GPU", "torch": "2.x", "nccl": 22703, "mib": 64, "repeats": 20,
               "date": "2026-01-01",
               "kernels": [{"kernel": "device copy", "bytes": 64 * mib, "ms": 0.05, "copy_ms": 0.05},
                           {"kernel": "nm 2:4 encode", "bytes": 64 * mib, "ms": 0.08,
                            "copy_ms": 0.05},
                           {"kernel": "pack", "bytes": 64 * mib, "ms": 0.1, "copy_ms": 0.05,
                            "tensors": 9}],
               "allreduce": {"mib": 64, "ms": 0.4, "staged_ms": 30.0},
               "training": [{"compressor": "none", "htod": 0, "dtoh": 0.0, "trace": "t.json"}]}
    text = bench_gpu.render(results, "python scripts/bench_gpu.py", None)
    # 0.05 / 0.08 = 0.625x against a 0.5x target; 0.05 / 0.1 = 0.5x against 0.8x.
    assert "| nm 2:4 encode | 0.080 | 839 | 0.62 | >= 0.5x: met |" in text, text
    assert "| pack (9 tensors) | 0.100 | 671 | 0.50 | >= 0.8x: missed |" in text, text
    assert "0.400 ms on the GPU path, 30.000 ms staged through host memory" in text
    assert "| none | 0 | 0 | t.json |" in text
