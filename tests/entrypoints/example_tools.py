"""A function tool the tool-calling tests share: bounded arguments (an enum and a small integer
range, no free strings, no extra keys), so that even a random model's forced call ends soon,
and the check of a call the openai SDK returns."""

import json

import jsonschema

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": WEATHER_PARAMETERS}}


def assert_valid_call(call, schemas: dict[str, dict], names: tuple[str, ...] | None = None
                      ) -> dict:
    """``call`` (an openai SDK tool call) calls one of ``names`` (default: every tool of
    ``schemas``, name -> parameters schema) with arguments valid for its schema; returns them."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in (names or tuple(schemas))
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name])
    return arguments
