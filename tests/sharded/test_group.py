"""The sharded level's worker group: a rank that hangs, dies or raises is a failure of
that call, the group is killed (no process left behind) and the next call restarts it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from conformance.core.compare import PropertyFailure
from conformance.core.target import ImplementationCrashed, ImplementationHung, ImplementationRaised
from conformance.sharded import forkserver
from conformance.sharded import group as groups
from conformance.sharded.cases import ShardedCallSpec, run_call
from conformance.sharded.strategies import make_case
from tests import pytest_process

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tests/sharded/broken_sharded.py"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(") ")[-1].startswith("Z"))


@pytest.fixture
def group(monkeypatch):
    monkeypatch.chdir(ROOT)
    made = []

    def make(attr: str) -> groups.WorkerGroup:
        g = groups.WorkerGroup(f"{BROKEN}:{attr}", world=2)
        made.append(g)
        return g

    yield make
    for g in made:
        g.close()


def _request(case):
    return {"query": case.query, "key": case.key, "value": case.value, "layout": case.layout,
            "causal": case.causal, "scale": case.scale, "dtype": case.dtype, "device": case.device,
            "grad_output": None}


@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked", "spawned"])
@pytest.mark.parametrize("attr, error, timeout", [("hangs", groups.GroupHung, 3.0),
                                                   ("dies", groups.GroupCrashed, 60.0),
                                                   ("raises", groups.GroupRaised, 60.0)])
def test_broken_rank_fails_the_call_and_restarts(group, attr, error, timeout, fork, monkeypatch):
    """Ranks forked from the fork server (the CPU default) and spawned ones alike."""
    monkeypatch.setenv("ATTENTION_CONFORMANCE_SHARDED_FORK", fork)
    g = group(attr)
    fine = make_case(world_size=2, layout="contiguous", shard=1, causal=False)
    assert len(g.call(_request(fine), 2, 60.0)) == 2
    first = g.pids()
    assert len(first) == 2 and all(_alive(p) for p in first)
    broken = fine.replace(causal=True)
    with pytest.raises(error) as caught:
        g.call(_request(broken), 2, timeout)
    assert caught.value.rank == 1 or attr == "hangs", caught.value
    # A hang or a crash kills every rank at once; so does a raise here, as rank 0 waits in
    # its recv for rank 1's block (after a grace of RAISE_GRACE seconds).
    assert g.pids() == [] and not any(_alive(p) for p in first), "a rank process was left behind"
    assert len(g.call(_request(fine), 2, 60.0)) == 2  # the run goes on, on a restarted group
    assert g.starts == 2
    assert all(isinstance(p, forkserver.ForkedRank) == (fork == "1") for p in g.processes)


def test_the_fork_server_ends_with_its_supervisor_and_takes_its_ranks(group, monkeypatch):
    """Closing the server (the run's end) leaves no rank behind, even one never stopped."""
    monkeypatch.setenv("ATTENTION_CONFORMANCE_SHARDED_FORK", "1")
    g = group("hangs")
    fine = make_case(world_size=2, layout="contiguous", shard=1, causal=False)
    assert len(g.call(_request(fine), 2, 60.0)) == 2
    ranks = g.pids()
    forkserver.close()
    assert all(p.wait(10) is not None for p in g.processes)
    assert not any(_alive(p) for p in ranks), "a forked rank outlived the fork server"


def test_group_starts_under_a_temp_folder_too_long_for_a_socket(group, tmp_path, monkeypatch):
    """A Unix socket's path has at most ~104-108 bytes; a deep TMPDIR (pytest's own, in CI)
    must not stop the group from starting, nor leave its socket folder behind."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(groups.tempfile, "tempdir", str(deep))
    g = group("hangs")
    fine = make_case(world_size=2, layout="contiguous", shard=1, causal=False)
    assert len(g.call(_request(fine), 2, 60.0)) == 2
    assert g.tmp.startswith(str(deep)) and g.socket_dir and not g.socket_dir.startswith(str(deep))
    socket_dir = g.socket_dir
    g.close()
    assert not os.path.exists(socket_dir)


def test_failures_are_property_failures(monkeypatch):
    """What the properties see: ImplementationHung / Crashed / Raised (PropertyFailures)."""
    assert all(issubclass(e, PropertyFailure) for e in (ImplementationHung, ImplementationCrashed,
                                                        ImplementationRaised))

    class Impl:
        name = "x"

    class Broken:
        def call(self, *args):
            raise groups.GroupCrashed("rank 1's process ended (exit code 3) during the call", 1)

    monkeypatch.setattr(groups, "group_for", lambda impl, device="cpu", world_size=None: Broken())
    with pytest.raises(ImplementationCrashed, match="rank 1's process ended"):
        run_call(Impl(), ShardedCallSpec(make_case(world_size=2, layout="contiguous")), timeout=1.0,
                 lse_declared=False)


def _workers_of(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "conformance.sharded.worker" in cmdline and marker in cmdline and _alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("attr, word", [("hangs", "hung"), ("dies", "crashed")])
def test_certificate_fails_saves_the_case_and_leaves_no_process(tmp_path, attr, word):
    """A whole run: the property FAILs with the case saved, the next property still runs
    (and passes), and no rank process is left when pytest ends."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    report = tmp_path / "cert"
    proc = pytest_process.run(
        [sys.executable, "-m", "pytest", "conformance/test_sharded.py", f"--impl={BROKEN}:{attr}",
         "--hypothesis-profile=ci", "--dtype=float64", "--example-timeout=4", "-p", "no:cacheprovider",
         "-k", "sharded_forward or sharded_layout_invariance", "-q", "--conformance-report", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"sharded_forward\s+sharded\s+FAIL", out), out[-3000:]
    assert word in out, out[-3000:]
    assert re.search(r"sharded_layout_invariance\s+sharded\s+PASS", out), out[-3000:]
    saved = re.findall(r"\S+\.npz", out)
    assert saved and any(Path(p).exists() or (ROOT / p).exists() for p in saved), out[-3000:]
    assert _workers_of(str(tmp_path)) == [], "rank processes left behind"


def test_a_hang_says_where_each_rank_waits_and_the_likely_cause(group):
    """Rank 1 waits in a barrier on the default group that rank 0 never reaches (rank 0
    waits in its receive): the hang names both calls, the lines that made them, and says
    the ranks' communication calls differ."""
    g = group("barrier")
    broken = make_case(world_size=2, layout="contiguous", shard=1, causal=True)
    with pytest.raises(groups.GroupHung) as caught:
        g.call(_request(broken), 2, 4.0)
    text = str(caught.value)
    assert "rank 0 waits in torch.distributed.recv" in text, text
    assert "rank 1 waits in torch.distributed.barrier (tests/sharded/broken_sharded.py" in text, text
    assert "wait in different communication calls" in text, text
    assert g.pids() == []


def test_stacks_name_a_rank_busy_outside_communication():
    """A rank whose innermost frame is the implementation's own (a sleep) is busy, not
    waiting: the cause says so (pure parsing of a faulthandler dump)."""
    from conformance.sharded import stacks

    dump = ('Current thread 0x00007f (most recent call first):\n'
            '  File "/x/tests/sharded/broken_sharded.py", line 27 in misbehave\n'
            '  File "/x/conformance/sharded/worker.py", line 60 in run_case\n'
            '  File "/x/conformance/sharded/worker.py", line 130 in main\n')
    where = stacks.blocked_at(dump)
    assert where is not None and where.collective is None and "broken_sharded.py:27 in misbehave" in where.caller
    waiting = stacks.Blocked("torch.distributed.recv", "ring.py:66 in exchange")
    text = stacks.likely_cause({0: waiting, 1: where}, [], 2)
    assert "rank(s) [1] are not in communication" in text and "while rank(s) [0] wait" in text, text
    assert stacks.blocked_at("no dump here") is None


def test_ranks_that_all_raise_at_different_times_keep_the_group(group):
    """Rank 1 raises at once, rank 0 five seconds later (past the grace): rank 0 was still
    computing, not waiting in communication, so it is waited for; every rank raised, the
    group is in step and the next call reuses it (no restart)."""
    g = group("raises_unevenly")
    fine = make_case(world_size=2, layout="contiguous", shard=1, causal=False)
    assert len(g.call(_request(fine), 2, 60.0)) == 2
    first = g.pids()
    with pytest.raises(groups.GroupRaised, match="refuses causal calls"):
        g.call(_request(fine.replace(causal=True)), 2, 60.0)
    assert g.pids() == first and g.starts == 1 and g.restarts == 0
    assert len(g.call(_request(fine), 2, 60.0)) == 2
