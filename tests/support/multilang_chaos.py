"""The chaos run with MultiLangDaemon children (``tests/multilang_apps/chaos_child.py``)
instead of a native processor: the same fleet, faults and audit, while the children crash,
hang in their shutdown handler and flood stdout. Besides the audit it reports what must hold
for children: none is left in the process table once the fleet is gone, and the workers'
memory stays bounded (their peak resident size, sampled all along)."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.audit import AuditReport, audit
from tests.support.chaos import ROOT, ChaosResult, ChaosRig, ChaosSettings, _parents, repeats
from tests.support.proctable import pids_running
from tests.support.waiting import wait_for

CHILD = ROOT / "tests" / "multilang_apps" / "chaos_child.py"
CHILD_ENV = "KCLPY_CHAOS_CHILD"
#: the run's seed, from which every child draws its misbehaviour
CHILD_SEED_ENV = "KCLPY_CHAOS_CHILD_SEED"
BEHAVIOURS = ("crash", "hang", "flood")


@dataclass
class MultiLangChaosResult:
    chaos: ChaosResult
    #: misbehaviours the children reported, by kind
    behaviours: Counter[str] = field(default_factory=Counter)
    #: kclpy_multilang_child_failures_total by reason, over every worker process
    child_failures: Counter[str] = field(default_factory=Counter)
    #: children of this run still running after the fleet stopped (their pids)
    children_left: list[int] = field(default_factory=list)
    #: the largest resident size any worker process had (bytes), and how many were sampled
    peak_rss: int = 0
    workers_sampled: int = 0

    def figure_lines(self) -> list[str]:
        behaviours = ", ".join(f"{kind} {self.behaviours[kind]}" for kind in BEHAVIOURS)
        failures = ", ".join(f"{reason} {n}" for reason, n in sorted(self.child_failures.items()))
        return [
            *self.chaos.figure_lines(),
            f"children: {behaviours}; kclpy_multilang_child_failures_total: "
            f"{failures or 'none'}; left running: {len(self.children_left)}",
            f"peak worker resident size: {self.peak_rss / 2**20:.0f} MiB over "
            f"{self.workers_sampled} worker processes",
        ]


class _MemoryWatch:
    """Samples the resident size of the processes whose command line holds ``marker``."""

    def __init__(self, marker: str, interval_s: float = 0.5) -> None:
        self._marker = marker
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.peak = 0
        self.seen: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="chaos-memory", daemon=True)

    def start(self) -> _MemoryWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for pid in pids_running(self._marker):
                self.seen.add(pid)
                self.peak = max(self.peak, _rss(pid))


def _rss(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_multilang_chaos(
    kinesis_url: str, dynamodb_url: str, workdir: Path, settings: ChaosSettings,
    rates: dict[str, float], say: Callable[[str], None] = print,
) -> MultiLangChaosResult:  # fmt: skip
    """Run the fleet as MultiLangDaemon workers under chaos, with children misbehaving at
    ``rates`` (``crash``, ``hang``, ``flood``), let it catch up, stop it, and audit."""
    started = time.monotonic()
    run_folder = workdir / "children"
    run_folder.mkdir(parents=True, exist_ok=True)
    properties = workdir / "app.properties"
    properties.write_text(
        f"executableName = {sys.executable} {CHILD} {run_folder}\n"
        "strayStdout = skip\n"
        "timeoutInSeconds = 10\n")
    with ChaosRig(kinesis_url, dynamodb_url, workdir, settings, "mlchaos", say) as rig:
        chaos = ChaosResult(settings, AuditReport(), logs=rig.logs)
        result = MultiLangChaosResult(chaos)
        memory = _MemoryWatch(rig.application).start()
        rig.stack.callback(memory.stop)
        env = {CHILD_ENV: ",".join(f"{kind}={rate}" for kind, rate in rates.items()),
               CHILD_SEED_ENV: str(settings.seed)}
        fleet = rig.window(chaos, ["--properties", str(properties)], env=env,
                           counter=("kclpy_multilang_child_failures_total", "reason"))
        say(f"chaos over after {time.monotonic() - started:.0f} s; the fleet catches up")
        wait_for(lambda: rig.ledger.missing_count() == 0, settings.catch_up_timeout_s,
                 f"every produced record to be processed (logs in {rig.logs})", interval=0.5)
        fleet.wait_up(60)
        chaos.sigterm_exit_codes.extend(fleet.terminate(*fleet.slots))
        result.child_failures = fleet.harvested
        try:
            wait_for(lambda: not pids_running(str(run_folder)), 30, "the children to end")
        except AssertionError:
            result.children_left = pids_running(str(run_folder))
        memory.stop()
        result.peak_rss, result.workers_sampled = memory.peak, len(memory.seen)
        samples = rig.sampler.stop()
        rig.ledger.record_lease_samples(samples)
        chaos.throttles_injected = rig.kinesis_proxy.faults("throttle", "GetRecords")
        chaos.server_errors_injected = rig.dynamodb_proxy.faults("error_5xx")
        journal = rig.ledger.journal()
        chaos.report = audit(rig.ledger.produced(), journal, samples,
                             _parents(rig.kinesis, rig.stream))
        chaos.largest_repeat, chaos.largest_repeat_s = repeats(journal)
    behaviours_log = run_folder / "behaviours.log"
    if behaviours_log.exists():
        result.behaviours = Counter(line.split()[0]
                                    for line in behaviours_log.read_text().splitlines())
    chaos.duration_s = time.monotonic() - started
    return result
