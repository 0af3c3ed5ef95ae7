"""The server's scheduler batches (issue 42): jobs decode together through lily_py.batch.Batcher
on the bundled demo checkpoint, in-process on the engine (no HTTP: the jobs are queued while
the worker is held, so that every run batches the same way).

Each job's text equals its single-stream greedy answer (no token lost or crossed), all 8 decode
in the same steps, cancelling one leaves the others, a job the batch cannot serve (logprobs) runs
alone in FIFO order, and a bad job fails alone.
"""
from __future__ import annotations

import asyncio

import pytest

import lily_py
from engine_backend import ENGINE, require_engine
from lily_py.serve.scheduler import CHUNK, DONE, ERROR, START, Job, Scheduler

require_engine()

PROMPTS = [f"And the {w} of the LORD" for w in
           ("word", "hand", "angel", "glory", "spirit", "house", "name", "voice")]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def model():
    return lily_py.load(backend=ENGINE, context_length=256)


@pytest.fixture(scope="module")
def want(model):
    out = []
    for p in PROMPTS:
        model.reset()
        out.append(model.generate_text(p, max_tokens=MAX_TOKENS).text)
    model.reset()
    model.prompt_cache.clear()
    return out


async def drain(job: Job, log: list, on_chunk=None) -> tuple[str, list]:
    """A job's events until DONE (or ERROR before START): its text and event kinds; ``log`` gets
    (kind, job's prompt) in arrival order across jobs."""
    text, kinds = [], []
    while True:
        kind, value = await job.events.get()
        kinds.append(kind)
        log.append((kind, job.prompt))
        if kind == CHUNK:
            text.append(value.text)
            if on_chunk is not None:
                on_chunk(job, value)
        if kind == DONE or (kind == ERROR and START not in kinds):
            return "".join(text), kinds


def submit_all(sched: Scheduler, jobs: list[Job]) -> None:
    """Queue every job before the worker can take any (the condition's lock is reentrant)."""
    with sched._cond:
        for job in jobs:
            sched.submit(job)


def run_jobs(model, specs, on_chunk=None, **sched_kw):
    async def main():
        sched = Scheduler(model, max_queue=16, **sched_kw)
        loop = asyncio.get_running_loop()
        jobs = [Job(p, {"max_tokens": MAX_TOKENS, "temperature": 0.0, **kw}, loop) for p, kw in specs]
        log: list = []
        submit_all(sched, jobs)
        results = await asyncio.gather(*(drain(j, log, on_chunk) for j in jobs))
        await asyncio.to_thread(sched.stop)
        return results, log, sched.status()
    return asyncio.run(main())


def test_eight_jobs_decode_together(model, want):
    results, _, status = run_jobs(model, [(p, {}) for p in PROMPTS])
    assert [t for t, _ in results] == want
    assert all(k[0] == START and k[-1] == DONE for _, k in results)
    assert status["max_batch"] == 8 and status["peak_batch"] == 8
    assert status["completed"] == 8 and status["failed"] == status["cancelled"] == 0
    # 8 x 5 tokens: the first of each from its prefill, the other 4 in shared steps
    assert status["batched_steps"] == MAX_TOKENS - 1
    assert model._backend.engine.sequences == [model._backend.engine.active_sequence]


def test_cancelling_one_job_leaves_the_others(model, want):
    def on_chunk(job, chunk):
        if job.prompt == PROMPTS[2] and chunk.token is not None:
            job.cancel()                  # a client went away after its first token

    results, _, status = run_jobs(model, [(p, {}) for p in PROMPTS], on_chunk)
    texts = [t for t, _ in results]
    assert texts[:2] + texts[3:] == want[:2] + want[3:]
    assert want[2].startswith(texts[2]) and len(texts[2]) < len(want[2])
    assert status["cancelled"] == 1 and status["completed"] == 7


def test_a_job_the_batch_cannot_serve_runs_alone_in_order(model, want):
    specs = [(PROMPTS[0], {}), (PROMPTS[1], {}), (PROMPTS[2], {"logprobs": True}), (PROMPTS[3], {})]
    got_logprobs = []
    results, log, status = run_jobs(
        model, specs, lambda job, c: got_logprobs.append(getattr(c, "logprobs", None) is not None)
        if job.prompt == PROMPTS[2] else None)
    assert [t for t, _ in results] == want[:4]
    assert got_logprobs and all(got_logprobs)
    # FIFO: the two batched jobs finish before the logprobs job starts; the fourth waits for it
    assert log.index((START, PROMPTS[2])) > log.index((DONE, PROMPTS[0]))
    assert log.index((START, PROMPTS[2])) > log.index((DONE, PROMPTS[1]))
    assert log.index((START, PROMPTS[3])) > log.index((DONE, PROMPTS[2]))
    assert status["completed"] == 4 and status["peak_batch"] == 2


def test_a_bad_job_fails_alone(model, want):
    specs = [(PROMPTS[0], {}), (list(range(1, 300)), {}), (PROMPTS[1], {"temperature": -1.0}),
             (PROMPTS[2], {})]
    results, _, status = run_jobs(model, specs)
    assert results[0][0] == want[0] and results[3][0] == want[2]
    for _, kinds in results[1:3]:
        assert kinds == [ERROR]           # no START: the request was refused before it ran
    assert status["failed"] == 2 and status["completed"] == 2


def test_max_batch_one_runs_jobs_one_at_a_time(model, want):
    results, log, status = run_jobs(model, [(p, {}) for p in PROMPTS[:3]], max_batch=1)
    assert [t for t, _ in results] == want[:3]
    assert status["max_batch"] == 1 and status["batched_steps"] == 0
    starts = [i for i, (kind, _) in enumerate(log) if kind == START]
    dones = [i for i, (kind, _) in enumerate(log) if kind == DONE]
    assert starts[1] > dones[0] and starts[2] > dones[1]
