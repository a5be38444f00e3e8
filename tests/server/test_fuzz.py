"""Schemathesis fuzzing of the served OpenAPI schema: no generated input produces a 5xx.

Valid (positive) cases for every operation and invalid (negative) bodies for every route that takes one.
"""

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

EXAMPLES = 30
WITH_BODY = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}


def shorten(case) -> None:
    """Keeps generated requests cheap (few tokens, few choices) so hundreds of cases run fast."""
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(key), int) and case.body[key] > 8:
                case.body[key] = 8
        if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
            case.body["n"] = 2


def run_cases(op, mode) -> int:
    count = 0

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        nonlocal count
        shorten(case)
        case.call_and_validate(checks=[not_a_server_error], timeout=60)
        count += 1

    fuzz()
    return count


def test_no_server_errors(live):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 8
    total = 0
    for op in operations:
        total += run_cases(op, GenerationMode.POSITIVE)
        if op.path in WITH_BODY:
            total += run_cases(op, GenerationMode.NEGATIVE)
    assert total >= 200, total
