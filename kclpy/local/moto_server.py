"""``python -m kclpy.local.moto_server --port N``: moto's server with atomic conditional writes.

``python -m moto.server`` runs requests concurrently, which lets two conditional writes to one
item both succeed (see :class:`kclpy.local.moto_app.SerialApp`); this is the child process
:func:`kclpy.local.start_moto_server` runs instead.
"""

from __future__ import annotations

import argparse

from kclpy.local.endpoints import LOOPBACK
from kclpy.local.moto_app import make_moto_server


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Serve moto's AWS backends, one request at a time."
    )
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    make_moto_server(args.host, args.port).serve_forever()


if __name__ == "__main__":
    main()
