"""Local AWS endpoints over real HTTP on free loopback ports.

``start_embedded`` is what ``kclpy-worker --local`` runs on; the emulators started as child
processes (kinesis-mock, moto's server) are what the integration tests run against. Each
returns a :class:`LocalEndpoint`: point boto3's ``endpoint_url`` at ``.url`` and call
``.stop()`` (or use it as a context manager) when done.
"""

from kclpy.local.endpoints import (
    EmbeddedEndpoint,
    LocalEndpoint,
    LocalEndpointError,
    ProcessEndpoint,
    free_port,
    start_embedded,
    start_moto_server,
)
from kclpy.local.kinesis_mock import (
    KINESIS_LOCAL_VERSION,
    default_cache_dir,
    ensure_kinesis_mock_installed,
    start_kinesis_mock,
)

__all__ = [
    "KINESIS_LOCAL_VERSION",
    "EmbeddedEndpoint",
    "LocalEndpoint",
    "LocalEndpointError",
    "ProcessEndpoint",
    "default_cache_dir",
    "ensure_kinesis_mock_installed",
    "free_port",
    "start_embedded",
    "start_kinesis_mock",
    "start_moto_server",
]
