"""``kclpy consumers``, ``register-consumer``, ``deregister-consumer``: an application's
enhanced fan-out consumer, looked after by an operator.

Fan-out workers register their application's consumer at start-up and never deregister it
(``kclpy/retrieval/registration.py`` does it the Java KCL's way); these commands show every
consumer of a stream, register one ahead of a deployment, and remove one no longer wanted.
Their flags and help are their entries in ``kclpy.ops.commands``'s table.
"""

from __future__ import annotations

import argparse
import json
from typing import IO, Any

from kclpy.ops.text import print_table
from kclpy.retrieval.registration import (
    ConsumerRegistration,
    RegistrationSettings,
    deregister,
    list_consumers,
)


def registration(args: argparse.Namespace, kinesis: Any) -> ConsumerRegistration:
    return ConsumerRegistration(
        kinesis, args.consumer_name or args.application_name, stream_name=args.stream_name,
        stream_arn=args.stream_arn, settings=RegistrationSettings(
            register_retries=args.register_retries, describe_retries=args.describe_retries,
            backoff_s=args.retry_backoff_ms / 1000))


def list_command(args: argparse.Namespace, kinesis: Any, out: IO[str]) -> int:
    consumers = list_consumers(kinesis, registration(args, kinesis).stream_arn)
    consumers.sort(key=lambda consumer: str(consumer["ConsumerName"]))
    if args.json:
        json.dump([{**c, "ConsumerCreationTimestamp": str(c.get("ConsumerCreationTimestamp"))}
                   for c in consumers], out, indent=2)
        out.write("\n")
        return 0
    rows = [["CONSUMER", "STATUS", "CREATED", "ARN"]]
    rows += [[str(c["ConsumerName"]), str(c.get("ConsumerStatus", "-")),
              str(c.get("ConsumerCreationTimestamp", "-")), str(c["ConsumerARN"])]
             for c in consumers]
    print_table(rows, out)
    out.write(f"{len(consumers)} consumer(s)\n")
    return 0


def register_command(args: argparse.Namespace, kinesis: Any, out: IO[str]) -> int:
    out.write(registration(args, kinesis).get_or_create() + "\n")
    return 0


def deregister_command(args: argparse.Namespace, kinesis: Any, out: IO[str]) -> int:
    """Exit 0 when deregistered, 1 when there was no such consumer."""
    consumer = registration(args, kinesis)
    if deregister(kinesis, consumer.stream_arn, consumer.consumer_name):
        out.write(f"deregistered {consumer.consumer_name}\n")
        return 0
    out.write(f"no consumer {consumer.consumer_name} on {consumer.stream_arn}\n")
    return 1
