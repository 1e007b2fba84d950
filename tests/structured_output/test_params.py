"""StructuredOutputsParams and SamplingParams.structured_outputs: vLLM's names, every bad value named."""

from __future__ import annotations

import json

import pydantic
import pytest

from vllm_spec import SamplingParams
from vllm_spec.sampling_params import StructuredOutputsParams


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_one_constraint_each_kind():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert StructuredOutputsParams(json=schema).kind == "json"
    assert StructuredOutputsParams(json=json.dumps(schema)).json == StructuredOutputsParams(json=schema).json
    assert json.loads(StructuredOutputsParams(json=Person).json)["required"] == ["name", "age"]
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    assert StructuredOutputsParams(grammar='root ::= "a"').kind == "grammar"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(structural_tag={"type": "structural_tag"}).kind == "structural_tag"


@pytest.mark.parametrize("kwargs, named", [
    ({}, "exactly one of"),
    ({"json_object": False}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, r"\['regex', 'choice'\]"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json must be a JSON object"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": 3}, "structured_outputs.grammar must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": "ab"}, "structured_outputs.choice must be a non-empty list"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be True, False or None"),
    ({"json_object": True, "disable_any_whitespace": 1}, "disable_any_whitespace must be True or False"),
    ({"json_object": True, "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
    ({"regex": "\ud800"}, "structured_outputs.regex is not valid Unicode"),
    ({"json": '{"type": "number", "maximum": NaN}'}, "structured_outputs.json is not valid JSON"),
    ({"structural_tag": [1]}, r"structural_tag must be a JSON object \(a dict or its JSON text\)"),
])
def test_bad_constraints_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_a_dict_and_names_unknown_fields():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.batch_fields.structured
    assert not SamplingParams().batch_fields.structured
    with pytest.raises(ValueError, match=r"structured_outputs has unknown fields \['guided_json'\]"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(ValueError, match="structured_outputs must be an object"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match="guided_decoding must be None .*structured_outputs"):
        SamplingParams(guided_decoding={"json": {}})
    # A changed field is checked again on the engine's copy.
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    assert p.checked_copy().structured_outputs == p.structured_outputs
