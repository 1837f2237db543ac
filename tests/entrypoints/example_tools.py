"""A function tool the tool-calling tests share: bounded arguments (an enum and a small integer
range, no free strings, no extra keys), so that even a random model's forced call ends soon."""

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city",
    "parameters": WEATHER_PARAMETERS}}
