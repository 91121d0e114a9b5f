"""retro.fault_injection: arming by site and hit, the SQLite-style sweep, and the site table."""

from __future__ import annotations

import numpy as np
import pytest

import retro
import retro.fault_injection as fi
from conftest import dataset


def test_unknown_sites_and_bad_hits_are_rejected():
    with pytest.raises(ValueError):
        fi.arm("nowhere", 1)
    with pytest.raises(ValueError):
        fi.arm("compute", 0)
    for hit, seconds in [(0, 0.1), (1, 0), (1, 61), (True, 0.1), (1, "1")]:
        with pytest.raises(ValueError):
            fi.stall("compute", hit, seconds)


def test_a_stall_parks_the_chosen_hit_and_the_call_then_completes(model_path):
    """A stall holds the training call at its chosen compute (the trainer's step in progress, seen
    from another thread), then lets it go on and finish as if nothing had happened; reset clears an
    unreached stall."""
    import threading
    import time

    with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ubatch=64) as c:
        with retro.Trainer(c, optimizer=retro.SGD(lr=0.01)) as tr:
            fi.reset()
            fi.stall("compute", 3, 0.2)
            done: list[retro.EpochMetrics] = []
            worker = threading.Thread(target=lambda: done.append(tr.epoch(dataset(1))))
            worker.start()
            while not fi.stalling() and worker.is_alive():
                time.sleep(0.001)
            assert fi.hits("compute") == 3 and fi.stalling()  # parked at its third compute
            worker.join()
            assert not fi.stalling() and done[0].train_micro_batches == 4 and fi.failures("compute") == 0
            fi.stall("compute", 100, 5.0)
            fi.reset()
            tr.epoch(dataset(1))  # would park for 5 s at its 100th compute had reset not cleared it
            assert not fi.stalling()


@pytest.mark.parametrize("persistent", [False, True])
def test_sweep_fails_every_hit_of_graph_build_until_the_epoch_completes(model_path, persistent):
    seen: list[type] = []

    def epoch():
        with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ubatch=64) as c:
            with retro.Trainer(c, optimizer=retro.SGD(lr=0.01)) as tr:
                tr.epoch(dataset(1))  # 4 micro-batches: 4 graph builds

    def check(inj: fi.Injection) -> None:
        assert isinstance(inj.error, retro.GraphBuildError), inj.error
        seen.append(type(inj.error))

    result = fi.sweep(epoch, "graph_build", persistent=persistent, check=check)
    assert [i.hit for i in result.injections] == [1, 2, 3, 4]
    assert result.completed_after == 4 and len(seen) == 4


def test_the_sites_are_the_forks_table_and_each_counts_its_hits(model_path):
    """The site list comes from the fork's table; one micro-batch passes each site once (the
    fused head's support question is asked of a fused step only), but the optimizer's state,
    allocated once per trainer, at its first step (once per buffer type: one on the CPU)."""
    assert fi.SITES[0] == "fused_head" and fi.SITES[-1] == "compute" and len(set(fi.SITES)) == len(fi.SITES)
    with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ubatch=64) as c:
        with retro.Trainer(c, optimizer=retro.SGD(lr=0.01), head="fused") as tr:
            fi.reset()
            tr.epoch(dataset(1))
            assert {s: fi.hits(s) for s in fi.SITES} == dict.fromkeys(fi.SITES, 4) | {"opt_state": 1}
            fi.arm("graph_build", 2)
            with pytest.raises(retro.GraphBuildError, match="failed to build the training graph"):
                tr.epoch(dataset(1))
            assert fi.failures("graph_build") == 1 and tr.iteration == 6  # 4 + the first micro-batch's step


def test_a_compute_fault_fails_real_work_and_leaves_the_parameters_partly_written(model_path):
    """The compute site runs the graph up to the middle one of its optimizer updates and stops:
    some weights have taken the step, others have not, and the trainer is poisoned."""
    with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ubatch=256) as c:
        with retro.Trainer(c, optimizer=retro.SGD(lr=0.1)) as tr:
            before = m.parameters()
            fi.arm("compute", 1)
            with pytest.raises(retro.ComputeError):
                tr.epoch(dataset(1))
            after = m.parameters()
            trained = [n for n in before if n != "token_embd.weight"]
            moved = [n for n in trained if not np.array_equal(before[n], after[n])]
            assert 0 < len(moved) < len(trained), f"{len(moved)} of {len(trained)} weights moved"
            assert tr.poisoned


def test_upstreams_loop_reports_a_failed_step_instead_of_returning(model_path):
    """retro.testing.upstream_epoch (fork patch 0047): a step that cannot be allocated stops
    upstream's loop with AllocationError, its partial period discarded, and the trainer trains on;
    a failed compute raises ComputeError (before, both returned as if the epoch had run)."""
    import retro.testing

    with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ubatch=256) as c:
        with retro.Trainer(c, optimizer=retro.SGD(lr=0.01), accumulation=2) as tr:
            fi.reset()
            fi.arm("alloc", 2)
            with pytest.raises(retro.AllocationError, match="graph allocation failed"):
                retro.testing.upstream_epoch(tr, dataset(4))
            assert tr.iteration == 1 and tr.period_position == 0  # the period of the failed step went
            fi.reset()
            assert retro.testing.upstream_epoch(tr, dataset(4)).optimizer_steps == 2
            fi.arm("compute", 1)
            with pytest.raises(retro.ComputeError):
                retro.testing.upstream_epoch(tr, dataset(4))
            fi.reset()
