"""A small mutation check of kclpy's guard functions: does a named fast test subset fail when
one comparison, boolean or guard in them is changed?

Each mutant changes one site of one named function: a comparison flipped (``==`` and ``!=``,
``<`` and ``>=``, ``is`` and ``is not``, ``in`` and ``not in``, ...), ``and`` swapped with
``or``, a ``not`` dropped, ``True`` and ``False`` swapped, or a guard skipped (an ``if``
whose body ends in ``return``, ``raise`` or ``continue`` made never to fire). The mutated
module is written to a copy of the ``kclpy`` package in a temporary folder, put first on
``PYTHONPATH`` for one pytest run (``-x``, no xdist): the working tree is never changed, so
an interrupted run leaves nothing behind. A mutant that no test fails on *survived*; every
survivor needs a test that kills it or a reason it is equivalent (docs/reliability.md,
"Mutation check").

Not run by the suite (it is a pytest run per mutant). One target at a time::

    python -m tests.mutation fence
    python -m tests.mutation state-dynamodb --list     # the mutants, without running them

mutmut was not used: it rewrites the whole package into ``mutants/`` with trampolines in
every function and runs the tests from there, which the project's ``tests.support`` imports
and its subprocess-started workers do not follow; the sites that matter here are a few
dozen, which a per-mutant pytest run of a fast subset covers.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: a comparison operator -> its negation
FLIPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt,
    ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}


@dataclass(frozen=True)
class Target:
    """Functions of one module (``Class.method`` or ``function``) and the tests that
    should kill every mutant of them."""

    module: str
    functions: tuple[str, ...]
    tests: tuple[str, ...]
    #: (function, the site's source text) pairs: when given, only these sites are mutated
    #: (``--only`` aside). Named by text, not by index, so that a change elsewhere in the
    #: function does not silently move the check to other sites; a pair that matches no
    #: site stops the run.
    sites: tuple[tuple[str, str], ...] = ()


#: the state tests about what a commit checks (fast: in-process moto, SQLite)
STATE_VALIDATION = " or ".join([
    "only_read", "read_as_absent", "created_again", "never_lose_an_update",
    "before_keys_had_an_incarnation", "commit_together"])

TARGETS: dict[str, Target] = {
    "fence": Target(
        "kclpy/leases/fence.py",
        ("LeaseFence.guard", "LeaseFence.write", "LeaseFence.holds", "LeaseFence._holding",
         "LeaseFence._expired", "LeaseFence._attempt", "LeaseFence._landed", "own_write"),
        ("tests/leases/test_fence.py",)),
    "state-transaction": Target(
        "kclpy/state/transaction.py",
        ("StateTransaction.get", "StateTransaction._version_of", "StateTransaction.over_limits",
         "StateTransaction._stage"),
        ("tests/state/test_transaction.py", "tests/state/test_store.py")),
    "state-dynamodb": Target(
        "kclpy/state/dynamodb.py", ("DynamoDBStateStore.items", "_condition"),
        ("tests/state/test_state.py", "-k", f"dynamodb and ({STATE_VALIDATION})")),
    "state-sql": Target(
        "kclpy/state/sql.py", ("SQLStateStore._write", "SQLStateStore._check_absent"),
        ("tests/state/test_state.py", "tests/state/test_sql.py", "-k",
         f"sqlite and ({STATE_VALIDATION}) or lock_waits_add_up")),
    "checkpoint": Target(
        "kclpy/checkpoint.py",
        ("Checkpointer.mark_delivered", "Checkpointer.checkpoint", "Checkpointer._write",
         "Checkpointer._refuse_if_retired", "Checkpointer._resolve"),
        ("tests/test_checkpoint.py",)),
    "handoff": Target("kclpy/leases/handoff.py", (), ("tests/leases/test_handoff.py",)),
    "park": Target("kclpy/leases/park.py", (), ("tests/ops/test_control.py", "-k", "park")),
    # the taker's side of a park: a parked lease is never planned for taking nor its expiry
    # awaited (the sites of the ``parked`` checks, and the known-keys check beside one; the
    # rest are the taker's own rules)
    "park-take": Target(
        "kclpy/leases/balancing.py", ("Balancer.next_expiry", "Balancer.plan"),
        ("tests/leases/test_balancing.py", "tests/leases/test_taker.py"),
        (("Balancer.next_expiry", "lease.parked is not None"),
         ("Balancer.plan", "lease.parked is None"),
         ("Balancer.plan", "lease.parked is not None"),
         ("Balancer.plan", "known_lease_keys is not None"))),
    # the operator's park and resume, and the conditional writes they make: a park takes
    # the lease from its holder, a resume of a shard not parked writes nothing, and a write
    # whose answer was lost is told apart from one refused
    "park-control": Target(
        "kclpy/ops/control.py", ("park", "resume_shard", "_write_fresh", "_write"),
        ("tests/ops/test_control.py", "-k",
         "park or answer_was_lost or may_have_landed or held_lease_is_refused"
         " or deleted_before or taken_before")),
    # the worker's side: when the park policy and fail_on_data_loss park a shard, and what
    # the mark records (the sites of those two decisions and every site of ``_park_shard``;
    # the rest are the consumer's other rules, not run here)
    "park-policy": Target(
        "kclpy/consumer.py",
        ("ShardConsumer._initialize", "ShardConsumer._deliver", "ShardConsumer._park_shard"),
        ("tests/test_consumer.py", "tests/ops/test_control.py", "-k", "park_policy or parks"),
        (("ShardConsumer._initialize", "self._settings.fail_on_data_loss"),
         ("ShardConsumer._deliver",
          "policy == 'park' and failures >= self._settings.processor_error_attempts"),
         ("ShardConsumer._deliver", "policy == 'park'"),
         ("ShardConsumer._deliver", "failures >= self._settings.processor_error_attempts"),
         ("ShardConsumer._park_shard", "reason is None"),
         ("ShardConsumer._park_shard", "self.failure or {}"),
         ("ShardConsumer._park_shard", "True"))),
    # the lease side beyond the balancer: a parked lease is never handed over, assigned,
    # adopted at the end of a handoff, stolen by load nor aged out by shard sync (the
    # ``parked`` checks of each module; the rest of those functions are other rules)
    "park-lead": Target(
        "kclpy/leases/leading.py",
        ("LeaderTaker._hand", "LeaderTaker.hand_over", "LeaderTaker._discover"),
        ("tests/leases/test_handoff.py", "tests/leases/test_leader.py"),
        (("LeaderTaker._hand", "current.parked is not None"),
         ("LeaderTaker.hand_over", "lease.parked is not None"),
         ("LeaderTaker._discover", "lease.parked is not None"))),
    "park-leader": Target(
        "kclpy/leases/leader.py", ("plan",), ("tests/leases/test_leader.py",),
        (("plan", "lease.parked is not None"),)),
    "park-adopt": Target(
        "kclpy/leases/table.py", ("LeaseTable.evict",), ("tests/leases/test_handoff.py",),
        (("LeaseTable.evict", "lease.checkpoint_owner is None or lease.parked is not None"),
         ("LeaseTable.evict", "lease.parked is not None"))),
    "park-steal": Target(
        "kclpy/leases/assignment.py", ("LoadAssignment.steals",),
        ("tests/leases/test_assignment.py", "tests/leases/test_load.py",
         "tests/leases/test_load_sim.py::"
         "test_load_assignment_keeps_the_busiest_worker_within_115_percent_of_the_average"),
        (("LoadAssignment.steals", "lease.parked is not None"),)),
    "park-sync": Target(
        "kclpy/leases/shard_sync.py", ("aged_out",), ("tests/leases/test_shard_sync.py",),
        (("aged_out", "key in listed or lease is None or lease.parked"),)),
    "recovery-gaps": Target("kclpy/recovery/queue.py", (), ("tests/recovery/test_queue.py",)),
}


@dataclass(frozen=True)
class Mutant:
    """One change at one site: ``index`` counts the sites of the module in walk order."""

    index: int
    function: str
    line: int
    change: str
    #: the site's source text, unparsed (a guard's: its condition's), which ``Target.sites``
    #: names
    text: str


def functions_of(tree: ast.Module, names: Sequence[str]) -> Iterator[tuple[str, ast.AST]]:
    """The named functions' nodes; no names: every function of the module."""
    def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for node in body:
            if isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{node.name}"
                if not names or name in names:
                    yield name, node

    found = dict(walk(tree.body, ""))
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"no such function: {', '.join(missing)}")
    yield from found.items()


def _guard(node: ast.If) -> bool:
    last = node.body[-1]
    return isinstance(last, (ast.Return, ast.Raise, ast.Continue))


def sites(node: ast.AST) -> Iterator[tuple[ast.AST, int, str]]:
    """Every mutable site under ``node``: (the node, which of its changes, a description)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Compare):
            for i, op in enumerate(child.ops):
                if type(op) in FLIPS:
                    yield child, i, (f"{type(op).__name__} -> "
                                     f"{FLIPS[type(op)].__name__}")
        elif isinstance(child, ast.BoolOp):
            yield child, 0, "and -> or" if isinstance(child.op, ast.And) else "or -> and"
        elif isinstance(child, ast.UnaryOp) and isinstance(child.op, ast.Not):
            yield child, 0, "not dropped"
        elif isinstance(child, ast.Constant) and isinstance(child.value, bool):
            yield child, 0, f"{child.value} -> {not child.value}"
        elif isinstance(child, ast.If) and _guard(child):
            yield child, 0, "guard skipped"


def mutants(source: str, names: Sequence[str]) -> list[Mutant]:
    tree = ast.parse(source)
    found: list[Mutant] = []
    for name, function in functions_of(tree, names):
        for node, _, change in sites(function):
            text = ast.unparse(node.test if isinstance(node, ast.If) else node)
            found.append(Mutant(len(found), name, getattr(node, "lineno", 0), change, text))
    return found


def chosen_sites(target: Target, found: Sequence[Mutant]) -> list[Mutant]:
    """The mutants of ``target.sites`` (all of them when it names none)."""
    if not target.sites:
        return list(found)
    unmatched = [site for site in target.sites
                 if not any((m.function, m.text) == site for m in found)]
    if unmatched:
        raise SystemExit(f"no such site in {target.module}: {unmatched}")
    return [m for m in found if (m.function, m.text) in target.sites]


def mutated(source: str, names: Sequence[str], index: int) -> str:
    """The module's source with mutant ``index`` applied."""
    tree = ast.parse(source)
    all_sites = [site for _, function in functions_of(tree, names) for site in sites(function)]
    target, which, _ = all_sites[index]

    class Mutate(ast.NodeTransformer):
        def visit(self, node: ast.AST) -> ast.AST:
            node = self.generic_visit(node)
            if node is not target:
                return node
            if isinstance(node, ast.Compare):
                node.ops[which] = FLIPS[type(node.ops[which])]()
            elif isinstance(node, ast.BoolOp):
                node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            elif isinstance(node, ast.UnaryOp):
                return node.operand
            elif isinstance(node, ast.Constant):
                node.value = not node.value
            elif isinstance(node, ast.If):
                node.test = ast.Constant(False)
            return node

    return ast.unparse(ast.fix_missing_locations(Mutate().visit(tree)))


def environment(package: Path) -> dict[str, str]:
    """The copy of the package first, then the tree (``tests.support``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), str(ROOT)])}


def run(target: Target, package: Path, timeout_s: float) -> str:
    """``killed``, ``survived`` or ``timeout`` for the module as written in ``package``.
    Run from ``package`` (``python -m`` puts the working folder first on ``sys.path``) with
    pytest's own ``pythonpath = .`` turned off: either would put the tree's kclpy first."""
    tests = [str(ROOT / arg) if arg.startswith("tests/") else arg for arg in target.tests]
    argv = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
            "--rootdir", str(ROOT), "-n", "0", "-x", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "-o", "pythonpath=", *tests]
    try:
        done = subprocess.run(argv, cwd=package, env=environment(package),
                              capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if done.returncode == 0 else "killed"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--only", type=int, nargs="*", help="run only these mutant indexes")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one mutant's pytest run may take (default 600)")
    args = parser.parse_args(argv)
    target = TARGETS[args.target]
    source = (ROOT / target.module).read_text()
    found = mutants(source, target.functions)
    if args.only is None:
        found = chosen_sites(target, found)
    if args.list:
        for mutant in found:
            print(f"{mutant.index:3d} {target.module}:{mutant.line} {mutant.function}: "
                  f"{mutant.change}")
        return 0
    chosen = [m for m in found if args.only is None or m.index in args.only]
    outcomes: dict[str, list[Mutant]] = {"killed": [], "survived": [], "timeout": []}
    with tempfile.TemporaryDirectory(prefix="kclpy-mutant-") as folder:
        package = Path(folder)
        shutil.copytree(ROOT / "kclpy", package / "kclpy",
                        ignore=shutil.ignore_patterns("__pycache__"))
        module = package / target.module
        imported = subprocess.run(
            [sys.executable, "-c", "import kclpy; print(kclpy.__file__)"], cwd=package,
            env=environment(package), capture_output=True, text=True, check=True).stdout
        if not imported.startswith(str(package)):
            raise SystemExit(f"the copy is not what the tests import: {imported.strip()}")
        # the module as ast.unparse writes it, unmutated: the tests must pass on it
        module.write_text(ast.unparse(ast.parse(source)))
        if run(target, package, args.timeout) != "survived":
            raise SystemExit(f"the tests fail on {target.module} unmutated: nothing to learn")
        for mutant in chosen:
            module.write_text(mutated(source, target.functions, mutant.index))
            outcome = run(target, package, args.timeout)
            outcomes[outcome].append(mutant)
            print(f"{outcome:8s} {mutant.index:3d} {target.module}:{mutant.line} "
                  f"{mutant.function}: {mutant.change}", flush=True)
        module.write_text(source)
    print(f"{args.target}: {len(chosen)} mutants, {len(outcomes['killed'])} killed, "
          f"{len(outcomes['survived'])} survived, {len(outcomes['timeout'])} timed out")
    return 0
