"""Engines say which requests they run, before the step that first computes them
(``RequestsStarted``): a process that dies in that step has told the router which of its requests
may have caused it, and that the ones still waiting in its queue cannot have."""

from __future__ import annotations

from typing import Any

import zmq

from common.engine.engine import EngineOutput
from common.protocol import GenerateRequest, RequestOutput, RequestsStarted, decode_output
from common.sampling_params import SamplingParams
from common.service import RequestRecord
from tests.engine.conftest import prompt_ids
from tests.engine.test_output_batch import _OutputPathService, _pull, _receive_all, _StubEngine


def test_the_engine_names_the_requests_a_step_starts_before_its_forward(engine_factory: Any) -> None:
    engine = engine_factory(max_num_seqs=1)  # one at a time: "b" waits while "a" runs
    log: list[Any] = []
    engine.on_started = lambda ids: log.append(("started", list(ids)))
    execute = engine.runner.execute

    def logged_execute(*args: Any, **kwargs: Any) -> Any:
        log.append("forward")
        return execute(*args, **kwargs)

    engine.runner.execute = logged_execute
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(prompt_ids()[0])
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    # Each request once, in the step that first runs it, before that step's forward; none while
    # it waits, none in the steps that continue it.
    assert log == [("started", ["a"]), "forward", "forward", ("started", ["b"]), "forward", "forward"]


class _StartingEngine(_StubEngine):
    """A step that starts ``started`` (telling ``on_started`` first, as the engine does), then
    returns its outputs."""

    def __init__(self, outputs: list[EngineOutput], started: list[str]) -> None:
        super().__init__(outputs)
        self.started = started
        self.on_started: Any = None

    def step(self) -> list[EngineOutput]:
        self.on_started(self.started)
        return self.outputs


def test_the_service_tells_each_router_before_the_steps_outputs_every_choice_included() -> None:
    ctx = zmq.Context()
    pull_a, addr_a = _pull(ctx)
    pull_b, addr_b = _pull(ctx)
    outputs = [EngineOutput(request_id=r, new_token_ids=[7], num_prompt_tokens=3) for r in ("r0", "r1", "r1#1")]
    service = _OutputPathService(ctx, outputs, set())
    engine = _StartingEngine(outputs, ["r0", "r1"])
    service.engine = engine  # type: ignore[assignment]
    engine.on_started = service.announce_started
    for request_id, reply_to, n in [("r0", addr_a, 1), ("r1", addr_b, 2)]:
        request = GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                  sampling_params=SamplingParams(n=n, temperature=1.0), reply_to=reply_to)
        record = RequestRecord(request, "decode")
        service.records[request_id] = record
        if n == 2:
            service.records["r1#1"] = record
    try:
        service._step()
        got_a = [decode_output(raw) for raw in _receive_all(pull_a)]
        got_b = [decode_output(raw) for raw in _receive_all(pull_b)]
        assert got_a[0] == RequestsStarted(instance_id="decode-t", request_ids=["r0"])
        assert isinstance(got_a[1], RequestOutput) and got_a[1].request_id == "r0" and len(got_a) == 2
        assert got_b[0] == RequestsStarted(instance_id="decode-t", request_ids=["r1", "r1#1"])
        assert len(got_b) == 2 and [o.request_id for o in got_b[1].outputs] == ["r1", "r1#1"]  # type: ignore[union-attr]
    finally:
        for sock in [pull_a, pull_b, *service._outputs.values()]:
            sock.close(0)
        ctx.term()
