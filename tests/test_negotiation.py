"""Rank 0's decision in a full exchange (`coordinate`), on recorded reports without MPI."""
from fusionring.negotiation import TensorSpec, _Report, coordinate

ALLREDUCE = TensorSpec("allreduce", "float32", (2,), op="Average")
BARRIER = TensorSpec("barrier", "uint8", ())


def test_a_name_every_rank_submitted_is_ready_and_a_late_one_is_named_with_its_kind():
    reports = [_Report(0, [("allreduce.x", ALLREDUCE, 0.1), ("barrier", BARRIER, 7.0)]),
               _Report(1, [("allreduce.x", ALLREDUCE, 0.2)])]
    outcome = coordinate(reports, stall_warning_s=5.0, stall_shutdown_s=None)
    assert [r.name for r in outcome.ready] == ["allreduce.x"]
    assert "  barrier waiting 7.0 s for rank 1" in outcome.stall_warning.splitlines()
    assert "process set" not in outcome.stall_warning
    assert outcome.abort is None


def test_a_stall_inside_a_process_set_names_the_set_and_its_global_ranks():
    # The set's ranks 0 and 1 are the job's ranks 2 and 5.
    reports = [_Report(0, [("allreduce.x", ALLREDUCE, 9.0)]), _Report(1, [])]
    outcome = coordinate(reports, stall_warning_s=5.0, stall_shutdown_s=8.0,
                         global_ranks=[2, 5])
    assert "subset of ranks in the process set of ranks 2, 5 and are" in outcome.stall_warning
    assert "  allreduce 'x' waiting 9.0 s for rank 5" in outcome.stall_warning.splitlines()
    assert outcome.abort.startswith("fusionring stalled for more than 8 s waiting for tensors "
                                    "that some ranks in the process set of ranks 2, 5 never "
                                    "submitted: allreduce 'x' (missing on rank 5)")


def test_nothing_is_reported_before_the_warning_time():
    reports = [_Report(0, [("allreduce.x", ALLREDUCE, 1.0)]), _Report(1, [])]
    outcome = coordinate(reports, stall_warning_s=5.0, stall_shutdown_s=8.0)
    assert outcome.stall_warning is None and outcome.abort is None and not outcome.ready
