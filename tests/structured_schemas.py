"""A shared suite of JSON schemas for structured-output tests (Engine, native /generate, OpenAI response_format).

Each case is ``(name, prompt, schema)``; every output constrained by ``schema``
must parse as JSON and validate against it (``jsonschema``). The schemas cover
nested objects, arrays, enums, bounded numbers, ``anyOf``, required and optional
properties, and string lengths — features both built-in grammar backends support.
"""

from __future__ import annotations

from typing import Any

SchemaCase = tuple[str, str, dict[str, Any]]

SCHEMAS: list[SchemaCase] = [
    ("person", "Describe a person.", {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
    }),
    ("city", "Name a city and its country.", {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }),
    ("boolean_answer", "Is the sky blue?", {
        "type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
    }),
    ("enum_color", "Pick a primary color.", {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
    }),
    ("bounded_number", "Rate a movie from 1 to 10.", {
        "type": "object",
        "properties": {"movie": {"type": "string"}, "rating": {"type": "number", "minimum": 1, "maximum": 10}},
        "required": ["movie", "rating"],
    }),
    ("integer_range", "Pick a dice roll.", {
        "type": "object", "properties": {"roll": {"type": "integer", "minimum": 1, "maximum": 6}},
        "required": ["roll"],
    }),
    ("string_array", "List three fruits.", {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
        "required": ["fruits"],
    }),
    ("integer_array", "Give a few small primes.", {
        "type": "object",
        "properties": {"primes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                  "maxItems": 5}},
        "required": ["primes"],
    }),
    ("nested_object", "Describe a book and its author.", {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "author": {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
                       "required": ["name"]},
        },
        "required": ["title", "author"],
    }),
    ("array_of_objects", "List two people with their ages.", {
        "type": "object",
        "properties": {"people": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}}},
        "required": ["people"],
    }),
    ("any_of", "Give an id, either a number or a string.", {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}},
        "required": ["id"],
    }),
    ("optional_fields", "Describe a car; the color is optional.", {
        "type": "object",
        "properties": {"make": {"type": "string"}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                       "color": {"type": "string"}},
        "required": ["make", "year"],
    }),
    ("string_length", "Give a short nickname.", {
        "type": "object", "properties": {"nickname": {"type": "string", "minLength": 2, "maxLength": 8}},
        "required": ["nickname"],
    }),
    ("nullable", "What is the middle name, if any?", {
        "type": "object", "properties": {"middle_name": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["middle_name"],
    }),
    ("top_level_array", "List two colors.", {
        "type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2,
    }),
    ("enum_array", "Which weekdays are weekend days?", {
        "type": "object",
        "properties": {"days": {"type": "array", "maxItems": 2, "items": {"enum": ["Saturday", "Sunday", "Monday"]}}},
        "required": ["days"],
    }),
    ("const_field", "Report status.", {
        "type": "object", "properties": {"status": {"const": "ok"}, "code": {"type": "integer"}},
        "required": ["status", "code"],
    }),
    ("deep_nesting", "Describe a company's address.", {
        "type": "object",
        "properties": {"company": {"type": "object", "properties": {"address": {
            "type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"]}}, "required": ["address"]}},
        "required": ["company"],
    }),
    ("defs_ref", "Give two points.", {
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"]}},
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    }),
    ("mixed_types", "Describe a product.", {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "price": {"type": "number", "minimum": 0},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["name", "price", "in_stock", "tags"],
    }),
    ("pattern_string", "Give a US zip code.", {
        "type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
    }),
    ("small_object", "Give a key and a value.", {
        "type": "object", "properties": {"key": {"type": "string", "maxLength": 10}, "value": {"type": "integer"}},
        "required": ["key", "value"], "additionalProperties": False,
    }),
]

# (name, prompt, regex): outputs must satisfy ``re.fullmatch``.
REGEXES: list[tuple[str, str, str]] = [
    ("date", "When did the first moon landing happen?", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("yes_no", "Is Paris in France?", r"(yes|no)"),
    ("phone", "Give a phone number.", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("word", "Name an animal in lowercase.", r"[a-z]+"),
    ("email", "Give an email address.", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)"),
]
