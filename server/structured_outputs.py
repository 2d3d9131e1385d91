"""Structured-output requests -> ``StructuredOutput``: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extension, on both generation endpoints."""

from __future__ import annotations

import json

from servelm.scheduler.structured_output import StructuredOutput
from servelm.server.errors import bad_request
from servelm.server.protocol import GenerationRequest, StructuredOutputsParams

# Any JSON object: OpenAI's JSON mode.
ANY_OBJECT = '{"type": "object"}'


def structured_output_spec(req: GenerationRequest) -> StructuredOutput | None:
    """What the request's output must match, or None; 400 naming the field for a malformed one.
    (Whether a schema, regex or grammar compiles is checked by ``GrammarCompiler.compile``.)"""
    rf, so = req.response_format, req.structured_outputs
    if so is not None:
        if rf is not None and rf.type != "text":
            raise bad_request("Set 'response_format' or 'structured_outputs', not both.", param="structured_outputs")
        return _from_structured_outputs(so)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json", ANY_OBJECT, param="response_format")
    if rf.json_schema is None:
        raise bad_request(
            "Missing required parameter: 'response_format.json_schema'.", param="response_format.json_schema"
        )
    schema = rf.json_schema.schema_
    text = "{}" if schema is None else json.dumps(schema, ensure_ascii=False)
    return StructuredOutput("json", text, param="response_format.json_schema.schema")


def _from_structured_outputs(so: StructuredOutputsParams) -> StructuredOutput | None:
    given = [
        name
        for name, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise bad_request(
            f"'structured_outputs' takes one constraint, got {len(given)}: {', '.join(given)}.",
            param="structured_outputs",
        )
    flexible = not so.disable_any_whitespace
    if not given:
        if so.disable_any_whitespace is not None:
            raise bad_request(
                "'structured_outputs' has no constraint: set one of json, regex, choice, grammar or json_object.",
                param="structured_outputs",
            )
        return None
    kind = given[0]
    param = f"structured_outputs.{kind}"
    if kind == "json":
        value = so.json_
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"'structured_outputs.json' is not valid JSON: {e}", param=param) from None
        if value is False:
            raise bad_request("'structured_outputs.json' is the schema false, which no output satisfies.", param=param)
        if value is True:
            value = {}  # the same schema: any JSON value (llguidance takes objects only)
        if not isinstance(value, dict):
            raise bad_request("'structured_outputs.json' must be a JSON schema (an object).", param=param)
        return StructuredOutput("json", json.dumps(value, ensure_ascii=False), param, flexible)
    if kind == "json_object":
        return StructuredOutput("json", ANY_OBJECT, param, flexible)
    if kind == "choice":
        if any(c == "" for c in so.choice or ()):
            raise bad_request("'structured_outputs.choice' entries must be non-empty strings.", param=param)
        return StructuredOutput("choice", json.dumps(so.choice, ensure_ascii=False), param)
    if kind == "regex":
        return StructuredOutput("regex", so.regex or "", param)
    return StructuredOutput("grammar", so.grammar or "", param)
