"""The parameter server's settings: a time limit <= 0 means no limit; a negative poll nap is refused, naming the
variable."""
import pytest

from fusionring.config import settings
from fusionring.ps import protocol

_VARIABLES = ("FUSIONRING_PS_TIMEOUT_S", "FUSIONRING_STALL_SHUTDOWN_S", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
              "HOROVOD_STALL_CHECK_DISABLE", "FUSIONRING_PS_POLL_SLEEP_US")


@pytest.fixture
def env(monkeypatch):
    """Set variables for one settings() read; the cached settings are read again after."""
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def read(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return settings(reload=True)

    yield read
    monkeypatch.undo()
    settings(reload=True)


def test_the_default_limit_is_60_s(env):
    assert env().ps_timeout_s == 60.0
    assert protocol.timeout_s() == 60.0
    assert protocol.heartbeat_interval(60.0) == 2.0 and protocol.heartbeat_interval(2.0) == 0.5


@pytest.mark.parametrize("value", ["0", "-1", "-0.5"])
def test_a_limit_of_zero_or_less_is_no_limit(env, value):
    assert env(FUSIONRING_PS_TIMEOUT_S=value).ps_timeout_s is None
    assert protocol.timeout_s() is None
    assert protocol.longest(None, 3.0) is None and protocol.times(2, None) is None


def test_the_stall_shutdown_limit_still_takes_precedence(env):
    env(FUSIONRING_PS_TIMEOUT_S="0", FUSIONRING_STALL_SHUTDOWN_S="3")
    assert protocol.timeout_s() == 3.0


def test_a_negative_poll_nap_is_refused_naming_the_variable(env):
    with pytest.raises(ValueError, match="FUSIONRING_PS_POLL_SLEEP_US='-5'"):
        env(FUSIONRING_PS_POLL_SLEEP_US="-5")
    assert env(FUSIONRING_PS_POLL_SLEEP_US="0").ps_poll_sleep_us == 0
