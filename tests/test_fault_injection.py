"""fault_injection: arming by site and hit, and the SQLite-style sweep."""

from __future__ import annotations

import pytest

import fault_injection as fi
import retro

from conftest import dataset


def test_unknown_sites_and_bad_hits_are_rejected():
    with pytest.raises(ValueError):
        fi.arm("nowhere", 1)
    with pytest.raises(ValueError):
        fi.arm("compute", 0)


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


def test_each_before_compute_site_raises_its_own_class(model_path):
    expected = {"batch_init": retro.BatchInitError, "memory_init": retro.MemoryInitError,
                "output_reserve": retro.OutputReserveError, "graph_build": retro.GraphBuildError,
                "alloc": retro.AllocationError, "compute": retro.ComputeError}
    assert set(expected) == set(fi.SITES)
    for site, cls in expected.items():
        with retro.Model.load(model_path, devices=[], trainable=True) as m, retro.Context(m, n_ubatch=64) as c:
            with retro.Trainer(c, optimizer=retro.SGD(lr=0.01)) as tr:
                fi.arm(site, 2)
                with pytest.raises(cls):
                    tr.epoch(dataset(1))
                assert fi.failures(site) == 1
                assert tr.poisoned == (site == "compute")
        fi.reset()
