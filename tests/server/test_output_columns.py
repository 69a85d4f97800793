"""A step's outputs cross the server's processes by field and come back as the same outputs."""

from __future__ import annotations

import pickle

from treadle.core.request import FinishReason, ReqOutput
from treadle.server.detokenizer import Detokenizer
from treadle.server.ipc import BatchStrOut, BatchTokenIDOut, RegisterDecode, StrOutput


def _outputs() -> list[ReqOutput]:
    return [
        ReqOutput("a", [5], None, None, 3, 1, 0),
        ReqOutput("b", [6, 7], FinishReason.STOP, "2", 4, 9, 2, new_output_logprobs=[-0.5, -0.25],
                  new_output_top_logprobs=[[(6, -0.5)], [(7, -0.25)]], input_token_logprobs=[None, -1.0],
                  input_top_logprobs=[None, [(1, -1.0)]], spec_verify_steps=3, new_verify_lengths=[2]),
        ReqOutput("c", [], FinishReason.ABORT, None, 2, 0, 0, embedding=[0.5, 1.5]),
        ReqOutput("d", [8], None, None, 2, 1, 0, input_token_logprobs=[]),  # empty, not None: kept so
    ]


def test_outputs_survive_the_trip_by_field_with_every_field() -> None:
    outputs = _outputs()
    message = pickle.loads(pickle.dumps(BatchTokenIDOut(outputs)))
    assert message.outputs == outputs and message == BatchTokenIDOut(outputs)
    strs = [StrOutput(**{**vars(out), "text_delta": f"<{out.rid}>"}) for out in outputs]
    assert pickle.loads(pickle.dumps(BatchStrOut(strs))).outputs == strs


def test_the_detokenizer_splits_a_step_by_worker_and_forgets_finished_requests() -> None:
    detokenizer = Detokenizer()
    for rid, worker_id in (("a", 1), ("b", 0), ("c", 1), ("d", 0)):
        detokenizer.handle_routed(RegisterDecode(rid, True, [], worker_id))
    routed = detokenizer.handle_routed(pickle.loads(pickle.dumps(BatchTokenIDOut(_outputs()))))
    assert {worker_id: [out.rid for out in batch.outputs] for worker_id, batch in routed.items()} == {
        1: ["a", "c"], 0: ["b", "d"]}
    b, d = routed[0].outputs
    assert d.input_token_logprobs == []
    assert (b.finished_reason, b.finished_detail, b.new_output_logprobs) == ("stop", "2", [-0.5, -0.25])
    assert routed[1].outputs[1].embedding == [0.5, 1.5]
    assert detokenizer.worker_of == {"a": 1, "d": 0}  # b and c finished
