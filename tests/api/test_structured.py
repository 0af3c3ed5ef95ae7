"""generate(response_format=...) on the demo checkpoint (a model that knows no JSON): every
answer parses and matches the schema, on the reference and on the engine (emu)."""
import json

import pytest

import lily_py

pytest.importorskip("llguidance", reason="the structured extra (llguidance) is not installed")

SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "busy"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"],
                  "additionalProperties": False},
    },
    "required": ["mood", "inner"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}

_MODELS = {}


def _load(backend):
    if backend not in _MODELS:
        _MODELS[backend] = lily_py.load(backend=backend)
    return _MODELS[backend]


def valid(obj):
    """A small validator of SCHEMA (jsonschema is not a dependency)."""
    return (isinstance(obj, dict) and set(obj) <= {"mood", "tags", "inner"} and obj.get("mood") in ("calm", "busy")
            and isinstance(obj.get("inner"), dict) and set(obj["inner"]) == {"n"}
            and isinstance(obj["inner"]["n"], bool)
            and ("tags" not in obj or (isinstance(obj["tags"], list) and len(obj["tags"]) <= 2
                                       and all(t in ("a", "b") for t in obj["tags"]))))


def check_seeds(backend, seeds):
    demo = _load(backend)
    for seed in seeds:
        r = demo.generate_text("Describe:", max_tokens=60, temperature=1.0, seed=seed, response_format=FORMAT)
        obj = json.loads(r.text)
        assert valid(obj), (seed, r.text)
        assert r.finish_reason == "stop", (seed, r.finish_reason, r.text)


@pytest.mark.parametrize("backend,seeds", [("reference", range(3)), ("emu", range(1))])
def test_json_schema_answers_validate(backend, seeds):
    check_seeds(backend, seeds)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "emu"])
def test_json_schema_answers_validate_20_seeds_of_20(backend):
    """The done-when run: 20 seeds out of 20 valid (minutes on the emulator: the slow tier)."""
    check_seeds(backend, range(20))


def test_choice_regex_and_json_object():
    demo = _load("reference")
    r = demo.generate_text("Pick:", max_tokens=20, temperature=1.0, seed=1,
                           response_format={"type": "choice", "choices": ["yes", "no", "maybe"]})
    assert r.text in ("yes", "no", "maybe")
    r = demo.generate_text("Date:", max_tokens=20, temperature=1.0, seed=2,
                           response_format={"type": "regex", "regex": r"20[0-9]{2}-[01][0-9]"})
    assert len(r.text) == 7 and r.text[:2] == "20" and r.text[4] == "-"
    r = demo.generate_text("Obj:", max_tokens=40, temperature=0.0, response_format={"type": "json_object"})
    assert r.finish_reason != "stop" or isinstance(json.loads(r.text), dict)


def test_invalid_schema_raises_with_the_compilers_message():
    demo = _load("reference")
    with pytest.raises(ValueError, match="nope"):
        demo.generate("x", response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
    with pytest.raises(ValueError, match="type must be"):
        demo.generate("x", response_format={"type": "xml"})
