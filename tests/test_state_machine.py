"""A stateful property test: hypothesis drives epoch, cancel at micro-batch k, a fault at any site
and hit, checkpoint, restore into a new trainer and close, in any order, against a small
pure-Python model of the observable contract state (optimizer iteration, accumulation position,
poisoned, the errors each call must raise)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import retro
import retro.fault_injection as fi
from conftest import dataset, stateful_settings

PER_EPOCH = 4  # one window of 256 tokens in micro-batches of 64
# the sites every micro-batch passes (the optimizer's state is allocated once per trainer)
BEFORE_COMPUTE = [s for s in fi.SITES if s not in ("compute", "opt_state")]


class TrainerContract(RuleBasedStateMachine):
    model_path = None  # set by the test

    @initialize(accumulation=st.sampled_from([1, 2, 3]), adamw=st.booleans(), fused=st.booleans())
    def open(self, accumulation: int, adamw: bool, fused: bool) -> None:
        self.accumulation = accumulation
        self.head = "fused" if fused else "dense"
        self.optimizer = retro.AdamW(lr=1e-3) if adamw else retro.SGD(lr=0.01)
        self.model = retro.Model.load(self.model_path, devices=[], trainable=True)
        self.ctx = retro.Context(self.model, n_ctx=256, n_batch=256, n_ubatch=64)
        self.data = dataset(1)
        self.checkpoint: retro.Checkpoint | None = None
        self._new_trainer()

    def _new_trainer(self) -> None:
        self.tr = retro.Trainer(self.ctx, optimizer=self.optimizer, accumulation=self.accumulation, head=self.head)
        self.iteration, self.position, self.poisoned = 1, 0, False

    def _ran(self, micro_batches: int, *, keep_period: bool) -> None:
        total = self.position + micro_batches
        self.iteration += total // self.accumulation
        self.position = total % self.accumulation if keep_period else 0

    @rule()
    def epoch(self) -> None:
        fi.reset()
        if self.poisoned:
            with pytest.raises(retro.PoisonedTrainerError):
                self.tr.epoch(self.data)
            assert fi.hits("compute") == 0
            return
        assert self.tr.epoch(self.data).epoch_complete
        self._ran(PER_EPOCH, keep_period=True)

    @precondition(lambda self: not self.poisoned)
    @rule(k=st.integers(1, PER_EPOCH))
    def cancel(self, k: int) -> None:
        m = self.tr.epoch(self.data, progress=lambda p: p.done < k)
        assert m.train_micro_batches == k
        self._ran(k, keep_period=False)  # a cancel discards the incomplete period, even after the last micro-batch

    @precondition(lambda self: not self.poisoned)
    @rule(site=st.sampled_from(BEFORE_COMPUTE), hit=st.integers(1, PER_EPOCH))
    def fail_before_compute(self, site: str, hit: int) -> None:
        if site == "fused_head" and self.head != "fused":
            site = "batch_init"  # the fused head's support question is asked of a fused step only
        fi.reset()
        fi.arm(site, hit)
        with pytest.raises(retro.BeforeComputeError):
            self.tr.epoch(self.data)
        fi.reset()
        self._ran(hit - 1, keep_period=False)

    @precondition(lambda self: not self.poisoned)
    @rule(hit=st.integers(1, PER_EPOCH))
    def fail_compute(self, hit: int) -> None:
        fi.reset()
        fi.arm("compute", hit)
        with pytest.raises(retro.ComputeError):
            self.tr.epoch(self.data)
        fi.reset()
        self._ran(hit - 1, keep_period=True)
        self.poisoned = True

    @rule()
    def take_checkpoint(self) -> None:
        if self.poisoned:
            with pytest.raises(retro.PoisonedTrainerError):
                self.tr.checkpoint()
        elif self.position:
            with pytest.raises(retro.InvalidStateError):
                self.tr.checkpoint()
        else:
            self.checkpoint = self.tr.checkpoint()
            assert self.checkpoint.iteration == self.iteration

    @precondition(lambda self: self.checkpoint is not None)
    @rule()
    def restore_into_a_new_trainer(self) -> None:
        assert self.checkpoint is not None
        self.tr.close()
        self._new_trainer()
        self.tr.restore(self.checkpoint)
        self.iteration = self.checkpoint.iteration
        for name, p in self.checkpoint.parameters.items():
            assert np.array_equal(self.model.tensor(name), p), name

    @rule()
    def close_and_reopen(self) -> None:
        self.tr.close()
        with pytest.raises(retro.InvalidStateError):
            self.tr.epoch(self.data)
        self._new_trainer()

    @invariant()
    def observable_state_matches_the_model(self) -> None:
        if not hasattr(self, "tr"):
            return
        assert self.tr.poisoned == self.poisoned
        assert self.tr.iteration == self.iteration, (self.tr.iteration, self.iteration)
        if not self.poisoned:
            assert self.tr.period_position == self.position, (self.tr.period_position, self.position)

    def teardown(self) -> None:
        fi.reset()
        if hasattr(self, "tr"):
            self.tr.close()
            self.ctx.close()
            self.model.close()


def test_the_trainer_keeps_its_contract_under_any_sequence_of_calls(model_path):
    TrainerContract.model_path = model_path
    run_state_machine_as_test(
        TrainerContract,
        settings=stateful_settings(25, 12),
    )
