"""The memory planner: its numbers from the manifest, `kiln plan`, and the runtime refusing a batch that
cannot fit (the SmolLM2 end-to-end test holds the plan against a measured run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime import memory
from runtime.artifact import Artifact
from runtime.errors import IncompatibleArtifact
from runtime.generator import Generator
from runtime.sampling import SamplingParams


def kiln(*args):
    return subprocess.run([sys.executable, "-m", "runtime.kiln_cli", *map(str, args)], capture_output=True, text=True)


def test_compile_measures_each_variant(tiny_artifacts, family):
    manifest = Artifact.open(tiny_artifacts[family]).manifest
    for entry in manifest.variants.values():
        measured = entry.memory
        assert measured["weights_bytes"] > 0 and measured["baseline_bytes"] > 10 * memory.MIB
        assert measured["activation_bytes_per_token"] > 0


def test_kv_cache_is_what_the_runtime_allocates(tiny_artifacts):
    manifest = Artifact.open(tiny_artifacts["llama"]).manifest
    entry = manifest.variants["cpu-fp32"]
    interface = entry.interface  # tiny Llama: 2 layers, 2 kv heads, head_dim 16, fp32
    per_token = 2 * interface.layers * interface.kv_heads * interface.head_dim * 4
    planned = memory.variant_plan(manifest, entry, batch=8, context=100)
    assert planned.kv_bytes_per_token == per_token and planned.kv_bytes_per_sequence == 100 * per_token
    assert planned.kv_bytes == 8 * 100 * per_token  # shared buffers: held once
    unfused = memory.variant_plan(manifest, manifest.variants["cpu-fp32-unfused"], batch=8, context=100)
    assert unfused.kv_bytes == 2 * 8 * 100 * per_token  # past and present both alive during a step
    assert planned.bound_bytes == planned.peak_bytes + 8 * 100 * per_token
    # What the engine really holds: shared buffers never grow past the max context.
    generator = Generator.load(tiny_artifacts["llama"], max_batch_size=8)
    for _ in generator.stream([[5] * 20] * 8, SamplingParams(max_new_tokens=200, ignore_eos=True)):
        cache = generator.engine.running.cache if generator.engine.running else None
        if cache is not None:
            assert cache.capacity <= manifest.model.max_context
            assert cache[0].nbytes * len(cache) <= 8 * memory.variant_plan(
                manifest, entry, 8, manifest.model.max_context).kv_bytes_per_sequence


def test_largest_batch_and_context_fit_and_one_more_does_not(tiny_artifacts):
    manifest = Artifact.open(tiny_artifacts["llama"]).manifest
    entry = manifest.variants["cpu-fp32"]

    def bound(batch, context):
        return memory.variant_plan(manifest, entry, batch, context).bound_bytes

    # Budgets between two plans, since the baseline in them is measured and differs from machine to machine.
    budget = (bound(10, 128) + bound(11, 128)) // 2
    most = memory.largest_batch(entry.interface, entry.memory, budget, 128)
    assert most == 10 and bound(most, 128) <= budget < bound(most + 1, 128)
    budget = (bound(512, 64) + bound(512, 128)) // 2
    longest = memory.largest_context(entry.interface, entry.memory, budget, 512, 128)
    assert 64 <= longest < 128
    assert bound(512, longest) <= budget < bound(512, longest + 1)
    assert memory.largest_context(entry.interface, entry.memory, bound(1, 1) - 1, 1, 128) == 0


def test_kiln_plan_prints_and_exits_by_the_verdict(tiny_artifacts):
    art = tiny_artifacts["llama"]
    fits = kiln("plan", art, "--memory", "4GiB", "--batch", "8", "--context", "100")
    assert fits.returncode == 0, fits.stderr
    assert "measured at compile time" in fits.stdout and "fits: batch 8 x context 100 in 4.00 GiB" in fits.stdout
    facts = json.loads(kiln("plan", art, "--memory", "4GiB", "--json", "--variant", "cpu-fp32-unfused").stdout)
    assert facts["fits"] and facts["largest_batch"] > 32 and facts["context"] == 128
    small = kiln("plan", art, "--memory", "60MB", "--batch", "64")
    assert small.returncode == 1 and "DOES NOT FIT" in small.stdout
    for args, fragment in ((["--memory", "lots"], "'lots' is not a size"), ([], None)):
        bad = kiln("plan", *args) if fragment is None else kiln("plan", art, *args)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_plan_from_a_config_alone(tmp_path):
    config = tmp_path / "config.json"  # SmolLM2-135M's shapes: 134.5M parameters, tied embeddings
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                                  "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                  "vocab_size": 49152, "tie_word_embeddings": True,
                                  "max_position_embeddings": 8192}))
    facts = json.loads(kiln("plan", "--config", config, "--memory", "16GiB", "--json", "--context", "2048").stdout)
    assert facts["weights_bytes"] == 134_515_008 * 4 and facts["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert facts["max_context"] == 8192 and not facts["measured"]


def test_runtime_refuses_a_batch_that_cannot_fit(tiny_artifacts, monkeypatch):
    monkeypatch.setattr(memory, "free_host_memory", lambda: 40 * memory.MIB)
    with pytest.raises(IncompatibleArtifact, match=r"memory: batch 4096 x context 128 needs up to .* does not fit "
                                                   r"in .*; at most \d+ sequences at context 128 fit"):
        Generator.load(tiny_artifacts["llama"], max_batch_size=4096)
    Generator.load(tiny_artifacts["llama"], max_batch_size=1)  # one sequence fits


def test_parse_size():
    assert memory.parse_size("16GiB") == 16 << 30 and memory.parse_size("512 MB") == 512 * 10**6
    assert memory.parse_size("2g") == 2 << 30 and memory.parse_size("1e9") == 10**9
    with pytest.raises(ValueError, match="not a size"):
        memory.parse_size("16 parsecs")


KEEP_PROBE = """
import sys, threading
import numpy as np
from runtime import memory

def resident():
    return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmRSS"))

kept = memory.keep_freed_memory() if sys.argv[1] == "keep" else False
before = resident()
def burst():  # KV-sized arrays written and let go on a thread of their own, as the engine's loop does
    arrays = [np.ones((8, 1 << 20), np.float32) for _ in range(6)]
    del arrays
thread = threading.Thread(target=burst)
thread.start()
thread.join()
print(kept, resident() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status; glibc's mallopt")
def test_keep_freed_memory_holds_a_bursts_pages_in_the_process():
    """Freed KV buffers stay resident (the next burst takes pages already faulted in); by default glibc
    hands blocks this large back to the kernel."""
    def run(mode):
        done = subprocess.run([sys.executable, "-c", KEEP_PROBE, mode], capture_output=True, text=True, check=True)
        kept, grown = done.stdout.split()
        return kept == "True", int(grown)

    kept, grown = run("keep")
    if not kept:
        pytest.skip("the C library is not glibc: keep_freed_memory changes nothing here")
    assert grown >= 150 * memory.MIB  # the 192 MB written stayed
    assert run("default")[1] < 50 * memory.MIB
