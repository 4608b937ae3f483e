"""A child that speaks the protocol by hand, for the cases no amazon_kclpy application
produces: each daemon action is answered with the lines scripted in ``KCLPY_TEST_SCRIPT``
(JSON: action -> list of lines, or ``"exit:<code>"``; default: the correct status message).
Every message received is logged to ``KCLPY_TEST_OUTPUT`` with the working directory.

``KCLPY_TEST_LINGER=1`` makes it ignore the end of its input (and start a grandchild that
would outlive it), to be killed by the daemon. ``KCLPY_TEST_HANG=<action>`` makes it hang
(sleep, ignoring SIGTERM) once that action arrives, as a slow shutdown handler does.
"""

import json
import os
import signal
import subprocess
import sys
import time

script = json.loads(os.environ.get("KCLPY_TEST_SCRIPT", "{}"))
output = os.environ["KCLPY_TEST_OUTPUT"]


def log(entry):
    with open(output, "a", encoding="utf-8") as out:
        out.write(json.dumps(entry) + "\n")


if os.environ.get("KCLPY_TEST_LINGER"):
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    log({"grandchild": grandchild.pid})

for line in sys.stdin:
    message = json.loads(line)
    log({"received": message, "cwd": os.getcwd()})
    action = message["action"]
    if action == "checkpoint":
        continue
    if action == os.environ.get("KCLPY_TEST_HANG"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
    answer = script.get(action, [json.dumps({"action": "status", "responseFor": action})])
    if isinstance(answer, str) and answer.startswith("exit:"):
        sys.exit(int(answer.split(":", 1)[1]))
    for reply in answer:
        sys.stdout.write(reply + "\n")
        sys.stdout.flush()

if os.environ.get("KCLPY_TEST_LINGER"):
    time.sleep(3600)
