"""Structured outputs (runtime/structured.py) through the engine, `kiln serve` with the openai client,
`kiln batch` and run-model: sampled answers from a random-weight model parse and validate against
their format (jsonschema and re are the independent judges), constrained rows share batches with free
ones without changing them, and a bad format is refused before anything runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from runtime.generator import Generator
from runtime.sampling import SamplingParams
from runtime.structured import OutputFormat

from .test_batch import kiln_batch, read_jsonl, write_jsonl
from .test_server import KEY, MODEL, Server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                    "properties": {"city": {"type": "string", "maxLength": 6},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}( \((yes|no)\))?"
CHOICES = ["safe", "spam", "abuse"]
LARK = 'start: "(" item (", " item)* ")"\nitem: /[0-9]{1,2}/ | "x"\n'
GBNF = 'root ::= "(" item (", " item)* ")"\nitem ::= [0-9] [0-9]? | "x"\n'
LIST_PATTERN = r"\((?:[0-9]{1,2}|x)(?:, (?:[0-9]{1,2}|x))*\)"
PROMPTS = ["the quick brown fox", "cache keys and values", "decode a token", "prefill"]
SAMPLED = dict(max_new_tokens=400, temperature=1.0)  # a random model closes a string or a number by chance


@pytest.fixture(scope="module")
def generator(serve_artifact) -> Generator:
    return Generator.load(serve_artifact, threads=2)


def test_sampled_answers_under_a_json_schema_validate_100_of_100(generator):
    fmt = OutputFormat.json_schema(SCHEMA)
    params = [SamplingParams(seed=i, output_format=fmt, **SAMPLED) for i in range(100)]
    results = generator.generate([PROMPTS[i % 4] for i in range(100)], params)
    for result in results:
        assert result.finish_reason in ("stop", "eos"), result
        jsonschema.validate(json.loads(result.text), SCHEMA)
    # The same seeds again: a constrained sampled row draws what it drew before.
    again = generator.generate([PROMPTS[i % 4] for i in range(8)], params[:8])
    assert [r.token_ids for r in again] == [r.token_ids for r in results[:8]]


@pytest.mark.parametrize("fmt, judge", [
    (OutputFormat.regex(REGEX), lambda text: re.fullmatch(REGEX, text)),
    (OutputFormat.choice(CHOICES), lambda text: text in CHOICES),
    (OutputFormat.grammar(LARK), lambda text: re.fullmatch(LIST_PATTERN, text)),
    (OutputFormat.grammar(GBNF), lambda text: re.fullmatch(LIST_PATTERN, text)),
], ids=["regex", "choice", "lark", "gbnf"])
def test_sampled_answers_hold_regex_choice_grammar_and_json_object_100_of_100(generator, fmt, judge):
    params = [SamplingParams(seed=i, output_format=fmt, **SAMPLED) for i in range(100)]
    for result in generator.generate([PROMPTS[i % 4] for i in range(100)], params):
        assert result.finish_reason in ("stop", "eos") and judge(result.text), result


def test_constrained_and_free_rows_share_a_batch_and_change_nothing_of_each_other(generator):
    free = SamplingParams(max_new_tokens=24)
    constrained = SamplingParams(max_new_tokens=200, output_format=OutputFormat.json_schema(SCHEMA))
    alone_free = generator.generate(PROMPTS, free)
    alone_constrained = generator.generate(PROMPTS, constrained)
    mixed = generator.generate(PROMPTS * 2, [free] * 4 + [constrained] * 4)
    assert [r.token_ids for r in mixed[:4]] == [r.token_ids for r in alone_free]
    assert [r.token_ids for r in mixed[4:]] == [r.token_ids for r in alone_constrained]
    for result in alone_constrained:
        jsonschema.validate(json.loads(result.text), SCHEMA)


def _text_prefix(generator: Generator, tokens: list[int]) -> tuple[int, int]:
    """How many of the tokens, from the first, make text (a random model also writes bytes that are no
    UTF-8, which no text format allows): counting a cut inside a character still to be completed, and
    counting only whole characters."""
    data, whole = b"", 0
    for count, token in enumerate(tokens):
        data += bytes(generator.tokenizer.token_bytes(token))
        try:
            data.decode()
            whole = count + 1
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data":
                return count, whole
    return len(tokens), whole


def test_a_format_the_free_answer_already_fits_changes_no_token(generator):
    # 16 prompts: a random model's first token is text (not a stray UTF-8 byte) about half the time, so
    # at least 3 of them compare whole-character answers on any CPU's numbers.
    prompts = PROMPTS + [f"{a} {b}" for a in PROMPTS for b in PROMPTS if a != b][:12]
    free = generator.generate(prompts, SamplingParams(max_new_tokens=16))
    anything = generator.generate(prompts, SamplingParams(max_new_tokens=16, output_format=OutputFormat.regex(
        r"[\s\S]*")))
    compared = 0
    for prompt, answer, constrained in zip(prompts, free, anything, strict=True):  # equal as far as it is text
        valid, whole = _text_prefix(generator, answer.token_ids)
        assert constrained.token_ids[:valid] == answer.token_ids[:valid]
        if whole == 0:
            continue
        compared += 1
        text = generator.tokenizer.decode(answer.token_ids[:whole])
        chosen = generator.generate([prompt], SamplingParams(
            max_new_tokens=32, output_format=OutputFormat.choice([text, "zzz"])))[0]
        assert chosen.text == text and chosen.token_ids == answer.token_ids[:whole]
    assert compared >= 3


@pytest.mark.parametrize("fmt, message", [
    (OutputFormat.regex("[a-"), "invalid regex: .*unclosed character class"),
    (OutputFormat.json_schema({"type": "nope"}), "invalid json schema: .*nope"),
    (OutputFormat.json_schema("{not json"), "invalid json schema: the JSON schema is not JSON"),
    (OutputFormat.grammar("start: missing_rule"), "invalid grammar: .*missing_rule"),
    (OutputFormat.choice([]), "invalid choice: a choice needs at least one option"),
])
def test_a_bad_format_is_refused_in_one_line_before_anything_runs(generator, fmt, message):
    result = generator.generate(["the quick"], SamplingParams(output_format=fmt))[0]
    assert result.finish_reason == "error" and result.generated_tokens == 0
    assert re.match(message, result.error) and "\n" not in result.error, result.error


def test_beam_search_with_a_format_is_refused(generator):
    result = generator.generate(["the quick"], SamplingParams(num_beams=2, output_format=OutputFormat.json_object()))
    assert "not supported with beam search" in result[0].error


# -- kiln serve, with the openai client ------------------------------------------------------------

@pytest.fixture(scope="module")
def server(serve_artifact):
    running = Server(serve_artifact, "--api-key", KEY, "--max-batch-size", "16", "--threads", "2")
    yield running
    assert running.stop() == 0


def test_serve_holds_response_format_and_guided_fields_streaming_or_not(server):
    client = server.client()
    messages = [{"role": "user", "content": "describe a person"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in range(6):
        answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=seed,
                                                max_tokens=400, response_format=response_format)
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
        chunks = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=seed,
                                                max_tokens=400, response_format=response_format, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert streamed == answer.choices[0].message.content
    # Any JSON object: its strings have no bound, and a random model closes one by chance, so the answer
    # may run to max_tokens; it then must be the start of an object.
    for seed in range(3):
        as_object = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=300, temperature=1.0,
                                                   seed=seed, response_format={"type": "json_object"})
        content, finish = as_object.choices[0].message.content, as_object.choices[0].finish_reason
        assert isinstance(json.loads(content), dict) if finish == "stop" else content.startswith("{")
    for extra, judge in [({"guided_choice": CHOICES}, lambda t: t in CHOICES),
                         ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
                         ({"guided_grammar": LARK}, lambda t: re.fullmatch(LIST_PATTERN, t)),
                         ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)]:
        completion = client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=400, temperature=1.0,
                                               seed=3, n=3, extra_body=extra)
        for choice in completion.choices:
            assert choice.finish_reason == "stop" and judge(choice.text), (extra, choice)


def test_serve_refuses_a_bad_format_with_a_400_naming_it(server):
    import openai

    client = server.client()
    cases = [({"guided_regex": "[a-"}, "invalid regex"),
             ({"guided_json": {"type": "nope"}}, "invalid json schema"),
             ({"guided_choice": CHOICES, "guided_regex": "a"}, "give one output format"),
             ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema")]
    for extra, message in cases:
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            client.completions.create(model=MODEL, prompt="the quick", max_tokens=8, extra_body=extra)
    assert server.process.poll() is None


# -- kiln batch and run-model ----------------------------------------------------------------------

def test_batch_rows_take_formats_and_the_command_line_gives_a_default(serve_artifact, tmp_path):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a person"}], "max_tokens": 400,
            "temperature": 1.0, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    rows = [{"custom_id": f"j{i}", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "seed": i}}
            for i in range(20)]
    rows += [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": PROMPTS[i % 4], "max_tokens": 400, "temperature": 1.0, "seed": i}}
             for i in range(20)]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                 "body": {"model": MODEL, "prompt": "x", "guided_regex": "(unclosed"}})
    done = kiln_batch(serve_artifact, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl",
                      "--choice", ",".join(CHOICES), "--threads", "2")
    assert done.returncode == 1, done.stderr  # the bad row
    answers = {row["custom_id"]: row["response"]["body"]["choices"][0] for row in read_jsonl(tmp_path / "out.jsonl")}
    assert len(answers) == 40
    for i in range(20):
        jsonschema.validate(json.loads(answers[f"j{i}"]["message"]["content"]), SCHEMA)  # the row's own format
        assert answers[f"c{i}"]["text"] in CHOICES  # the command line's
    (error,) = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "bad" and "invalid regex" in json.dumps(error)


def test_run_model_takes_a_format_and_refuses_a_bad_one_before_loading(serve_artifact, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))

    def run_model(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "runtime.cli", str(serve_artifact), "--prompt", "a person",
                               "--max-new-tokens", "400", *args], capture_output=True, text=True, timeout=300)

    done = run_model("--json-schema", str(schema), "--temperature", "1", "--seed", "5")
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), SCHEMA)
    assert run_model("--choice", "yes,no").stdout.strip() in ("yes", "no")
    for args, message in [(("--regex", "[a-"), "run-model: error: --regex: invalid regex"),
                          (("--json-schema", str(tmp_path / "missing.json")), "cannot be read"),
                          (("--regex", "a", "--choice", "a,b"), "give one output format, not --regex and --choice")]:
        refused = run_model(*args)
        assert refused.returncode == 2 and message in refused.stderr and refused.stderr.count("\n") == 1, \
            refused.stderr
    assert Path(serve_artifact).is_dir()
