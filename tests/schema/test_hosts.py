"""One reading of "loopback" for the exporter (direct connection) and the processor (exposure warning)."""
import pytest

from traceml.schema.hosts import is_loopback


@pytest.mark.parametrize("host", ["localhost", "LocalHost", "127.0.0.1", "127.8.9.10", "::1"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "collector.example", "localhost.example", ""])
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback(host)  # a wildcard bind reaches beyond loopback; a name is never resolved
