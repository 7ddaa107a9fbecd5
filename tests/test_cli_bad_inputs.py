"""Every command's bad inputs, as a table: each row an argv, the files to create first, the exit code
wanted and a fragment of the one line on stderr. A new command adds its rows here.

Placeholders in argv and files: {tmp} is the row's own folder, {art} a copy of a compiled tiny
artifact, {ckpt} a folder holding only a tiny Llama's config.json (enough for the checks that run
before any weight is loaded)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
BINARY = bytes(range(0xc0, 0x100)) * 4  # not UTF-8 from its first byte
CONFIG = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256})
# A Llama of 2.6 TB of fp32 weights: refused from its config.json before any weight is looked for.
HUGE_CONFIG = json.dumps({**json.loads(CONFIG), "hidden_size": 16384, "intermediate_size": 53248,
                          "num_hidden_layers": 200, "num_attention_heads": 128, "vocab_size": 128256})


def recipe(source: str = "{ckpt}", max_context: int = 128) -> str:
    return (f'name: bad\nmodel: {{source: "{source}"}}\nexport: {{max_context: {max_context}}}\n'
            "variants:\n  - {name: cpu-fp32, target: onnxruntime}\n")


GOOD_PROMPTS = '{"prompt": "The quick"}\n'
ROWS = [
    # compile-model
    ("recipe of binary bytes", ["compile-model", "{tmp}/r.yaml"], {"r.yaml": BINARY}, 2,
     "r.yaml: not a UTF-8 YAML file"),
    ("no recipe", ["compile-model", "{tmp}/none.yaml"], {}, 2, "none.yaml: no such file"),
    ("malformed YAML", ["compile-model", "{tmp}/r.yaml"], {"r.yaml": "name: [x\n"}, 2, "malformed YAML"),
    ("compile over this host's memory", ["compile-model", "{tmp}/r.yaml"],
     {"r.yaml": recipe("{tmp}/huge"), "huge/config.json": HUGE_CONFIG}, 1, "GiB free; free memory, compile on"),
    ("compile over the output disk's free space", ["compile-model", "{tmp}/r.yaml", "--no-memory-check"],
     {"r.yaml": recipe("{tmp}/huge"), "huge/config.json": HUGE_CONFIG}, 1, "GiB free; free space, pass --out on"),
    ("unknown option", ["compile-model", "{tmp}/r.yaml", "--fast"], {"r.yaml": recipe()}, 2,
     "No such option '--fast'"),
    ("missing source", ["compile-model", "{tmp}/r.yaml"], {"r.yaml": recipe("{tmp}/nothing")}, 2,
     "no such file or folder"),
    ("folder without config.json", ["compile-model", "{tmp}/r.yaml"], {"r.yaml": recipe("{tmp}/empty"),
                                                                       "empty/x.txt": ""}, 2, "has no config.json"),
    ("config.json not JSON", ["compile-model", "{tmp}/r.yaml"], {"r.yaml": recipe("{tmp}/m"),
                                                                 "m/config.json": "{"}, 2, "is not valid JSON"),
    ("a .gguf that is not GGUF", ["compile-model", "{tmp}/r.yaml"], {"r.yaml": recipe("{tmp}/m.gguf"),
                                                                     "m.gguf": "hello"}, 2, "GGUF magic"),
    ("truncated GGUF header", ["compile-model", "{tmp}/r.yaml"], {"r.yaml": recipe("{tmp}/m.gguf"),
                                                                  "m.gguf": b"GGUF\x03\x00"}, 2, "truncated or corrupt"),
    ("unsupported family", ["compile-model", "{tmp}/r.yaml"], {
        "r.yaml": recipe("{tmp}/m"), "m/config.json": json.dumps({"model_type": "bert"})}, 2,
     "model type 'bert' is not in Kiln's family table"),
    ("max_context above the model's", ["compile-model", "{tmp}/r.yaml"], {"r.yaml": recipe(max_context=4096)}, 2,
     "4096 exceeds the model's max_position_embeddings 256"),
    ("--out over a foreign folder", ["compile-model", "{tmp}/r.yaml", "--out", "{tmp}/mine"],
     {"r.yaml": recipe(), "mine/notes.txt": "mine"}, 2, "is not a Kiln artifact"),
    # run-model
    ("no prompt", ["run-model", "{art}"], {}, 2, "give at least one --prompt"),
    ("prompts file of binary bytes", ["run-model", "{art}", "--prompts-file", "{tmp}/p.jsonl"],
     {"p.jsonl": BINARY}, 2, "p.jsonl: not a UTF-8 JSON lines file"),
    ("prompts file with no usable line", ["run-model", "{art}", "--prompts-file", "{tmp}/p.jsonl"],
     {"p.jsonl": "nope\n[1]\n"}, 2, "no line holds a prompt"),
    ("--output in a missing folder", ["run-model", "{art}", "--prompt", "x", "--output", "{tmp}/no/dir/o.jsonl"],
     {}, 2, "does not exist; create it first"),
    ("bad option value", ["run-model", "{art}", "--top-p", "high"], {}, 2, "'high' is not a valid float"),
    ("not an artifact", ["run-model", "{tmp}", "--prompt", "x"], {}, 2, "not a Kiln artifact"),
    ("unlisted file in a variant", ["run-model", "{art}", "--prompt", "x"], {"@art/variants/cpu-fp32/x.txt": "x"},
     2, "variants/cpu-fp32/x.txt is not listed in the manifest"),
    ("one bad line among good ones", ["run-model", "{art}", "--prompts-file", "{tmp}/p.jsonl", "--max-new-tokens",
                                      "2"], {"p.jsonl": GOOD_PROMPTS + "{oops\n"}, 1, "prompt 1: not JSON"),
    # compare-model
    ("compare without B", ["compare-model", "{art}"], {}, 2, "Missing argument 'B'"),
    ("gates file of binary bytes", ["compare-model", "{art}", "{art}", "--gates", "{tmp}/g.yaml"],
     {"g.yaml": BINARY}, 2, "g.yaml: not a UTF-8 YAML or JSON file"),
    ("prompts file of binary bytes", ["compare-model", "{art}", "{art}", "--prompts", "{tmp}/p.jsonl"],
     {"p.jsonl": BINARY}, 2, "p.jsonl: not a UTF-8 JSON lines file"),
    ("no text file", ["compare-model", "{art}", "{art}", "--text", "{tmp}/none.txt"], {}, 2, "none.txt: no such file"),
    # kiln
    ("unknown command", ["kiln", "bogus"], {}, 2, "No such command 'bogus'"),
    ("kiln plan: nothing to plan", ["kiln", "plan"], {}, 2, "give an ARTIFACT folder or --config"),
    ("kiln plan: bad size", ["kiln", "plan", "{art}", "--memory", "lots"], {}, 2, "'lots' is not a size"),
    ("kiln plan: config not JSON", ["kiln", "plan", "--config", "{tmp}/c.json"], {"c.json": "{"}, 2,
     "not valid JSON"),
    ("kiln plan: not a decoder config", ["kiln", "plan", "--config", "{tmp}/c.json"], {"c.json": "{}"}, 2,
     "not a decoder's config.json"),
    ("kiln plan: both memory and device", ["kiln", "plan", "{art}", "--memory", "1GiB", "--device", "cuda:0"], {},
     2, "not both"),
    ("kiln inspect: not an artifact", ["kiln", "inspect", "{tmp}"], {}, 2, "not a Kiln artifact"),
    ("kiln inspect: sizes incomplete", ["kiln", "inspect", "{art}", "--polygraphy-shapes", "batch=1"], {}, 2,
     "missing size 'seq'"),
    ("kiln export-for: unknown tool", ["kiln", "export-for", "vllm", "{art}", "{tmp}/o"], {}, 2, "'vllm' is not one of"),
    ("kiln export-for: folder not empty", ["kiln", "export-for", "genai", "{art}", "{tmp}"], {"x.txt": "x"}, 1,
     "already exists and is not an empty folder"),
    ("kiln export-for: tampered graph", ["kiln", "export-for", "genai", "{art}", "{tmp}/o"],
     {"@art/variants/cpu-fp32/model.onnx": "x"}, 1, "has the wrong size"),
    ("kiln pack: no artifact", ["kiln", "pack", "{tmp}/none", "-o", "{tmp}/a.kiln"], {}, 2, "does not exist"),
    ("kiln run: beams and temperature", ["kiln", "run", "{art}", "--prompt", "x", "--num-beams", "2",
                                         "--temperature", "0.5"], {}, 1, "set temperature to 0"),
    ("kiln verify: unlisted file", ["kiln", "verify", "{art}"], {"@art/variants/cpu-fp32/x.txt": "x"}, 1,
     "variants/cpu-fp32/x.txt is not listed in the manifest"),
    ("kiln verify: nothing there", ["kiln", "verify", "{tmp}/none"], {}, 2, "does not exist"),
    ("kiln install: not an archive", ["kiln", "install", "{tmp}/a.kiln", "--into", "{tmp}/srv"],
     {"a.kiln": "hello"}, 1, "corrupted or truncated archive"),
    ("kiln rollback: no previous", ["kiln", "rollback", "--into", "{tmp}"], {}, 1, "no previous version"),
    ("kiln keygen: key exists", ["kiln", "keygen", "{tmp}/k"], {"k.key": "x"}, 1, "already exists"),
    ("kiln serve: not an artifact", ["kiln", "serve", "{tmp}"], {}, 2, "not a Kiln artifact"),
    ("kiln serve: bad port", ["kiln", "serve", "{art}", "--port", "http"], {}, 2, "'http' is not a valid integer"),
    ("kiln batch: no input", ["kiln", "batch", "{art}", "{tmp}/in.jsonl", "{tmp}/out.jsonl"], {}, 2,
     "does not exist"),
    ("kiln batch: output in a missing folder", ["kiln", "batch", "{art}", "{tmp}/in.jsonl", "{tmp}/no/out.jsonl"],
     {"in.jsonl": '{"id": "a", "prompt": "x"}\n'}, 2, "does not exist; create it first"),
    ("kiln compile: binary recipe", ["kiln", "compile", "{tmp}/r.yaml"], {"r.yaml": BINARY}, 2,
     "not a UTF-8 YAML file"),
]


@pytest.fixture(scope="module")
def artifact(tiny_artifacts) -> Path:
    return tiny_artifacts["llama"]


@pytest.mark.parametrize("name,argv,files,code,fragment", ROWS, ids=[row[0] for row in ROWS])
def test_bad_input_is_one_line(name, argv, files, code, fragment, artifact, tmp_path):
    art = tmp_path / "art"
    if any("{art}" in a for a in argv):
        shutil.copytree(artifact, art)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(CONFIG)
    names = {"tmp": tmp_path, "art": art, "ckpt": tmp_path / "ckpt"}

    def fill(text: str) -> str:
        for key, value in names.items():
            text = text.replace("{" + key + "}", str(value))
        return text

    for relative, content in files.items():
        path = art / relative.removeprefix("@art/") if relative.startswith("@art/") else tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(fill(content).encode() if isinstance(content, str) else content)
    command = [str(BIN / argv[0]), *map(fill, argv[1:])]
    env = None
    if argv[0] == "compile-model":  # refused before any weight is loaded or heavy library imported
        env = {**os.environ, "PYTHONPATH": str(_poisoned_heavy_imports(tmp_path / "poisoned"))}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, result.stderr
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def _poisoned_heavy_imports(folder: Path) -> Path:
    """A folder that, first on the path, makes importing torch, transformers or onnx end the process with
    exit code 3: a refusal that comes with its own code and line was given before any of them loaded."""
    for name in ("torch", "transformers", "onnx"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(f"import os\nos._exit(3)  # {name} imported before the refusal\n")
    return folder


def test_stale_staging_of_a_killed_compile_is_removed(tmp_path):
    from compiler.package import remove_stale_staging

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    final = tmp_path / "out"
    stale, running = tmp_path / f".out.partial-{gone.pid}", tmp_path / f".out.partial-{os.getpid()}"
    other = tmp_path / f".other.partial-{gone.pid}"
    for folder in (stale, running, other):
        (folder / "variants").mkdir(parents=True)
    assert remove_stale_staging(final) == [stale]
    assert not stale.exists() and running.exists() and other.exists()


def test_sigterm_exits_143_and_leaves_nothing(tiny_checkpoints, tmp_path):
    from tests.conftest import write_recipe

    recipe_path = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"])
    process = subprocess.Popen([str(BIN / "compile-model"), str(recipe_path), "--out", str(tmp_path / "out")],
                               stderr=subprocess.PIPE, text=True)
    for line in process.stderr:  # the stage log: signal once the export has started
        if "→ export" in line:
            break
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 143
    assert "interrupted; nothing was written" in process.stderr.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_run_model_writes_each_result_as_it_finishes(artifact, tmp_path):
    prompts, output = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"The quick {i}"}) + "\n" for i in range(200)))
    process = subprocess.Popen([str(BIN / "run-model"), str(artifact), "--prompts-file", str(prompts),
                                "--batch-size", "1", "--max-new-tokens", "60", "--output", str(output), "--threads",
                                "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (output.exists() and output.read_text().count("\n") >= 2):
        assert time.time() < deadline and process.poll() is None, "no result written while running"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)  # a failure after some results: those stay written
    assert process.wait(60) == 143
    assert f"what finished is in {output}" in process.stderr.read()
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert 2 <= len(rows) < 200 and all(r["finish_reason"] == "length" for r in rows)
    assert len({r["index"] for r in rows}) == len(rows)
