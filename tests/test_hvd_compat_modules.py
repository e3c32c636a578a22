"""Horovod 0.28.1 module paths user scripts import, with only `horovod` changed:
horovod.common.elastic, horovod.common.util, horovod.torch.elastic.sampler and .state."""
import os
import subprocess
import sys


def test_elastic_submodules_resolve_to_the_same_objects():
    import fusionring.torch as hvd
    from fusionring.common.elastic import (HorovodInternalError, HostsUpdatedInterrupt,
                                           HostUpdateResult, ObjectState, State, run_fn)
    from fusionring.torch.elastic import run
    from fusionring.torch.elastic.sampler import ElasticSampler
    from fusionring.torch.elastic.state import TorchState

    assert ElasticSampler is hvd.elastic.ElasticSampler
    assert TorchState is hvd.elastic.TorchState
    assert (State, ObjectState) == (hvd.elastic.State, hvd.elastic.ObjectState)
    assert issubclass(TorchState, ObjectState) and issubclass(ObjectState, State)
    assert HorovodInternalError is hvd.HorovodInternalError
    assert HostsUpdatedInterrupt is hvd.elastic.HostsUpdatedInterrupt
    assert callable(run_fn) and run is hvd.elastic.run
    # Horovod's values: an IntFlag where mixed is removed | added.
    assert [int(HostUpdateResult.no_update), int(HostUpdateResult.removed),
            int(HostUpdateResult.added), int(HostUpdateResult.mixed)] == [0, 1, 2, 3]
    assert callable(State.on_hosts_updated)


def test_common_modules_import_without_torch():
    # As Horovod's horovod.common modules, they load in a process with no framework.
    done = subprocess.run(
        [sys.executable, "-c", "import sys, fusionring.common.elastic, fusionring.common.util; "
                               "print('torch' in sys.modules)"],
        capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_common_util_helpers():
    from fusionring.common import util

    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert util.split_list([1, 2], 4) == [[1], [2], [], []]
    assert util.is_iterable([1]) and util.is_iterable("ab") and not util.is_iterable(3)
    assert [util.num_rank_is_power_2(n) for n in (0, 1, 2, 3, 4, 6, 8)] == [
        False, True, True, False, True, False, True]
    os.environ.pop("FR_TEST_UTIL_A", None)
    os.environ["FR_TEST_UTIL_B"] = "old"
    with util.env(FR_TEST_UTIL_A="1", FR_TEST_UTIL_B="new", FR_TEST_UTIL_C=None):
        assert (os.environ["FR_TEST_UTIL_A"], os.environ["FR_TEST_UTIL_B"]) == ("1", "new")
        assert "FR_TEST_UTIL_C" not in os.environ
    assert "FR_TEST_UTIL_A" not in os.environ and os.environ["FR_TEST_UTIL_B"] == "old"
    del os.environ["FR_TEST_UTIL_B"]
    # What this build has, in the form of Horovod's answers.
    assert util.mpi_built() is True and util.gloo_built() is False
    assert util.ddl_built() is False and util.ccl_built() is False
    assert isinstance(util.nccl_built(), int)
    assert util.extension_available("torch") is True
    assert util.extension_available("tensorflow") is False
