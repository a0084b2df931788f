"""A production step whose member's request was kept (its trace sent) goes out at once
(contract §14: it covers that request's last gap), however the member changed while the
step ran."""

from __future__ import annotations

import contextvars
import os

import pytest

import inferprof
from tests.instrumentation.helpers import captured
from tests.instrumentation.test_generation import _step_rows


def _kept_while_generating(engine):
    """A request whose response ended (kept, its trace sent) while the engine still
    generates for it, past its prefill."""
    with inferprof.request(model="m"):
        gen = engine.request(prompt_tokens=1)
        with engine.step() as step:
            step.prefill(gen, 1)
    return gen


def test_a_kept_member_cancelled_while_the_step_ran_still_sends_the_step_at_once():
    # The member's request was kept before the step; it is cancelled (another thread, a
    # client gone) while the step runs: the step still goes out at its end, as it did
    # when the step asked its members' records.
    def run(cap):
        engine = inferprof.Engine("e1")
        other = engine.request(prompt_tokens=1)  # keeps the engine busy throughout
        gen = _kept_while_generating(engine)
        sent = len(_step_rows(cap))
        with engine.step() as step:
            step.decode(gen)
            step.decode(other)
            gen.cancel()
        assert len(_step_rows(cap)) == sent + 1
        with engine.step() as step:  # a step without it: held
            step.decode(other)
        assert len(_step_rows(cap)) == sent + 1
        other.finish()

    with captured(mode="production", sample_rate=1.0) as cap:
        contextvars.Context().run(run, cap)


def test_a_kept_member_finished_while_the_step_ran_still_sends_the_step_at_once():
    def run(cap):
        engine = inferprof.Engine("e1")
        other = engine.request(prompt_tokens=1)
        gen = _kept_while_generating(engine)
        sent = len(_step_rows(cap))
        with engine.step() as step:
            step.prefill(other, 1)
            step.decode(gen, 2)  # (a member of the general path)
            gen.finish()
        assert len(_step_rows(cap)) == sent + 1
        other.finish()

    with captured(mode="production", sample_rate=1.0) as cap:
        contextvars.Context().run(run, cap)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_forked_child_still_sends_at_once_the_steps_of_a_request_kept_before():
    # A child that goes on with the parent's engine and requests: a member whose request
    # was kept (rec.kept, in the child's copy too) still has each step sent at once.
    def run(cap):
        engine = inferprof.Engine("e1")
        other = engine.request(prompt_tokens=1)
        gen = _kept_while_generating(engine)
        engine.flush()
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 if the step went out at its end
            ok = False
            try:
                cap.clear()
                with engine.step() as step:
                    step.decode(gen)
                    step.decode(other)
                ok = len(_step_rows(cap)) == 1
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        gen.finish()
        other.finish()

    with captured(mode="production", sample_rate=1.0) as cap:
        contextvars.Context().run(run, cap)
