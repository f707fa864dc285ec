"""A supervisor model's answer (``proxyvisor.supervisor_model.ModelAnswer``): its text and its usage travel
together, and no operation on the text can leave the usage behind."""

from __future__ import annotations

import dataclasses

import pytest

from proxyvisor.gate.verdict import Verdict, parse
from proxyvisor.proxy.supervise import ModelUse
from proxyvisor.supervisor_model import ModelAnswer

VERDICT = ('  {"requirements": [{"id": 1, "requirement": "fix the bug", "status": "matched", "basis": null,'
           ' "evidence": "x"}], "gaps": [], "handback": null, "verdict": "pass"}\n')


def test_text_operations_cannot_shed_an_answers_usage() -> None:
    """The text is reached only through ``text``: a string operation on the answer itself fails loudly instead of
    giving back a bare string whose usage reads as zero."""
    answer = ModelAnswer(VERDICT, 1200, 80, 0.0042)
    assert not isinstance(answer, str)
    with pytest.raises(AttributeError):
        answer.strip()  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        answer + "more"  # type: ignore[operator]
    with pytest.raises(dataclasses.FrozenInstanceError):
        answer.text = "edited"  # type: ignore[misc]
    trimmed = dataclasses.replace(answer, text=answer.text.strip())
    assert trimmed.text == VERDICT.strip()
    assert (trimmed.input_tokens, trimmed.output_tokens, trimmed.cost_usd) == (1200, 80, 0.0042)
    verdict = parse(answer.text)
    assert isinstance(verdict, Verdict) and verdict.outcome == "pass"
    assert (answer.input_tokens, answer.output_tokens, answer.cost_usd) == (1200, 80, 0.0042)  # parsing kept it


def test_a_requests_model_use_sums_the_answers_it_is_given() -> None:
    use = ModelUse()
    use.record("verify", ModelAnswer(VERDICT, 1200, 80, 0.0042))
    use.record("refute", ModelAnswer('{"findings": []}', 700, 15, None))
    use.record("verify", None)  # a failed call: counted, no usage
    assert (dict(use.calls), use.input_tokens, use.output_tokens, use.unpriced) == (
        {"verify": 2, "refute": 1}, 1900, 95, 1)
    assert use.cost_usd == pytest.approx(0.0042)
