"""The one place a boto3 session is made from a configured region.

botocore takes an empty ``AWS_DEFAULT_REGION`` for a region named ``""`` and only fails at the
first request, on an endpoint like ``https://kinesis..amazonaws.com``: a shell that exports the
variable without a value (``export AWS_DEFAULT_REGION=``) then looks like a broken endpoint.
Every entry point (``kclpy-worker``, ``kclpy``, the Spark source) makes its session here, so
the mistake is named once, as a configuration error, before anything starts.
"""

from __future__ import annotations

import boto3

from kclpy.errors import ConfigError


def aws_session(region: str | None) -> boto3.session.Session:
    """A session in ``region``, or where the boto3 chain says when it is None."""
    session = boto3.session.Session(region_name=region)
    if session.region_name == "":
        raise ConfigError("AWS_DEFAULT_REGION", "is set but empty: unset it, set it to a "
                                                "region name, or name a region in the options")
    return session
