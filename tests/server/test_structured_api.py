"""Structured output over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs` /
`guided_*` fields, through the official `openai` client. Replies validated by `jsonschema` and
Python's `re` (independent references); streamed replies equal the non-streamed ones; a bad
constraint is a 400 naming its field."""

from __future__ import annotations

import json
import re

import jsonschema
import pydantic
import pytest
from test_server_errors import check_error

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a city as JSON."}]


def _format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": schema, "strict": True},
    }


def test_chat_json_schema_streamed_and_not(client):
    kw = dict(model=None, messages=ASK, max_tokens=80, temperature=0)
    reply = client.chat.completions.create(**kw, response_format=_format(CITY))
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(**kw, response_format=_format(CITY), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    # Any object: this small model nests keys until max_tokens, so what shows the field took
    # hold is the start (the masks' own test is tests/test_structured_grammar.py).
    any_object = client.chat.completions.create(**kw, response_format={"type": "json_object"})
    assert any_object.choices[0].message.content.startswith('{"')
    assert not client.chat.completions.create(**kw).choices[0].message.content.startswith("{")


def test_completions_take_every_kind_of_constraint(client):
    def text(**extra) -> str:
        body = dict(model=None, prompt="Answer:", max_tokens=60, temperature=0, extra_body=extra)
        return client.completions.create(**body).choices[0].text

    whole = text(guided_json=CITY)
    jsonschema.validate(json.loads(whole), CITY)
    body = dict(model=None, prompt="Answer:", max_tokens=60, temperature=0, stream=True,
                extra_body={"guided_json": CITY})  # fmt: skip
    assert "".join(c.choices[0].text for c in client.completions.create(**body)) == whole
    jsonschema.validate(json.loads(text(structured_outputs={"json": CITY})), CITY)
    assert re.fullmatch(
        r"[0-9]{3}-[a-z]{2}", text(structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})
    )
    assert text(guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    assert re.fullmatch(r"(ab)+c", text(guided_grammar='start: ("ab")+ "c"'))
    # response_format {"type": "text"} asks for nothing
    assert text(response_format={"type": "text"}) == text()


def test_the_openai_clients_parse_helper(client):
    class City(pydantic.BaseModel):
        city: str
        population: int
        coastal: bool

    reply = client.chat.completions.parse(
        model=None, messages=ASK, max_tokens=80, temperature=0, response_format=City
    )
    assert isinstance(reply.choices[0].message.parsed, City)


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"response_format": _format({"type": "frobnicate"})}, "response_format"),
        (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
        (CHAT, {"response_format": {"type": "yaml"}}, "response_format"),
        (COMPLETIONS, {"guided_regex": "(unclosed"}, "guided_regex"),
        (
            COMPLETIONS,
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        (COMPLETIONS, {"guided_json": CITY, "guided_regex": "a+"}, "guided_regex"),
        (COMPLETIONS, {"guided_choice": []}, "guided_choice"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field(http, path, body, param):
    base = {"prompt": "x"} if path == COMPLETIONS else {"messages": ASK}
    check_error(http.post(path, json={**base, "max_tokens": 4, **body}), 400, param)


def test_logit_bias_forces_and_bars_tokens_over_http(client, http):
    yes = http.post("/tokenize", json={"prompt": " yes"}).json()["tokens"]
    assert len(yes) == 1
    kw = dict(model=None, prompt="The capital of France is", max_tokens=3, temperature=0)
    forced = client.completions.create(**kw, logit_bias={str(yes[0]): 100})
    assert forced.choices[0].text == " yes yes yes"
    free = client.completions.create(**kw).choices[0].text
    first = http.post("/tokenize", json={"prompt": free}).json()["tokens"][0]
    barred = client.completions.create(**kw, logit_bias={str(first): -100}).choices[0].text
    assert barred != free and not barred.startswith(free[:2])
    check_error(http.post(COMPLETIONS, json={"prompt": "x", "logit_bias": {"a": 1}}), 400,
                "logit_bias")  # fmt: skip
    check_error(http.post(COMPLETIONS, json={"prompt": "x", "logit_bias": {"5": 300}}), 400,
                "logit_bias")  # fmt: skip


def test_metrics_count_grammars_masks_and_refusals(client, http, scrape):
    def value(name: str) -> float:
        return scrape().get((name, frozenset()), 0.0)

    refused = value("quill:structured_refused_total")
    compiled = value("quill:structured_grammars_compiled_total")
    masks = value("quill:structured_masks_total")
    kw = dict(model=None, prompt="Answer:", max_tokens=8, temperature=0)
    client.completions.create(**kw, extra_body={"guided_choice": ["one", "two"]})
    bad = http.post(COMPLETIONS, json={"prompt": "x", "guided_regex": "(unclosed"})
    assert bad.status_code == 400
    assert value("quill:structured_refused_total") == refused + 1
    assert value("quill:structured_grammars_compiled_total") >= compiled + 1
    assert value("quill:structured_masks_total") > masks
    assert value("quill:structured_mask_seconds_total") > 0
